r"""A decoder-only transformer built from MHA Lab's attention layer: the course's own small language model.

Each of ``num_layers`` blocks is pre-norm, as in Llama:

.. math:: x \leftarrow x + \mathrm{Attn}(\mathrm{RMSNorm}(x)), \quad
          x \leftarrow x + W_2\,\mathrm{GELU}(W_1\,\mathrm{RMSNorm}(x))

The attention is ``mha_lab.cuda.MultiHeadAttention`` (grouped K/V heads, the NumPy layer's weight
layout): its ``project_qkv`` and ``project_out`` do the projections, and between them queries and
keys are rotated by RoPE in the book's ``"half"`` layout (pair i is coordinates i and i + d/2), at
frequencies the caller may change (``Rope``: position interpolation, NTK-aware scaling, YaRN).
The attention core in between is pluggable, so the evaluations can swap in a windowed cache or a
quantised one without touching the model. With ``sink_logit=True`` every head has a learned
logit :math:`b_i` that joins the softmax as one more column and is dropped (gpt-oss).

Tokens are bytes 0..255 and the start token ``BOS`` = 256, which opens every sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mha_lab.cpu.rope_scaling import (
    interpolation_frequencies,
    ntk_frequencies,
    rope_frequencies,
    yarn_attention_factor,
    yarn_frequencies,
)
from mha_lab.cuda.attention import MultiHeadAttention, causal_mask

__all__ = ["BOS", "VOCAB", "SCALINGS", "Config", "Rope", "ByteLM", "pool_kv_heads", "rotate", "causal_core",
           "eager_core", "attention_weights", "Core"]

BOS = 256
VOCAB = 257


@dataclass(frozen=True)
class Config:
    """The model's shape; ``train_len`` is the length it is trained on (the "training length" L)."""

    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    mlp_ratio: int = 4
    train_len: int = 256
    rope_base: float = 10000.0
    sink_logit: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class Rope:
    r"""RoPE's frequencies (d/2,) in radians per position and a factor m on q and k (scores scaled by m²).

    Plain RoPE is ``Rope.plain(d)``; the scalings of ``mha_lab.cpu.rope_scaling`` give other
    frequencies, and YaRN an ``attention_factor`` above 1.
    """

    freqs: torch.Tensor
    attention_factor: float = 1.0

    @classmethod
    def from_numpy(cls, freqs: np.ndarray, attention_factor: float = 1.0) -> Rope:
        return cls(torch.as_tensor(np.asarray(freqs, dtype=np.float64)), float(attention_factor))

    @classmethod
    def plain(cls, dim: int, base: float = 10000.0) -> Rope:
        return cls.from_numpy(rope_frequencies(dim, base))

    @classmethod
    def scaled(cls, method: str, dim: int, factor: float, train_len: int, base: float = 10000.0) -> Rope:
        """RoPE stretched ``factor`` times past ``train_len`` by ``method``, one of ``SCALINGS``."""
        if method == "rope":
            return cls.plain(dim, base)
        if method == "pi":
            return cls.from_numpy(interpolation_frequencies(dim, factor, base))
        if method == "ntk":
            return cls.from_numpy(ntk_frequencies(dim, factor, base))
        if method in ("yarn-turns", "yarn-index"):
            freqs = yarn_frequencies(dim, factor, train_len, base, ramp=method.removeprefix("yarn-"))
            return cls.from_numpy(freqs, yarn_attention_factor(factor))
        raise ValueError(f"method must be one of {SCALINGS}, got {method!r}")


SCALINGS = ("rope", "pi", "ntk", "yarn-turns", "yarn-index")
"""Plain RoPE, position interpolation, NTK-aware scaling, and YaRN with the paper's ramp (linear in the
turns a pair makes over the training length) and the reference code's (linear in the pair index)."""


def rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    r"""RoPE in the "half" layout: pair (x_i, x_{i+d/2}) of the vector at position p turns by :math:`p f_i`.

    Angles are computed in float64 (positions of a few thousand times frequencies near 1 lose
    digits in float32), then cast to x's dtype. ``positions`` may be (L,) or (L_q, L) (one row
    of positions per query, for caches that renumber their keys).
    Shapes: x (B, h, L, d), positions (L,) -> (B, h, L, d).
    """
    half = x.shape[-1] // 2
    angles = positions.to(torch.float64)[..., None] * freqs.to(torch.float64)  # (L, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


Core = Callable[..., torch.Tensor]
"""An attention core: ``core(q, k, v, sink_logits, layer=i, rope=rope) -> z``, q (B, h, L, d) and k, v
(B, h_kv, L, d) rotated at positions 0..L-1, z (B, h, L, d); ``sink_logits`` (h,) or None."""


def causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink_logits: torch.Tensor | None,
                **_: object) -> torch.Tensor:
    """Causal attention by PyTorch's fused kernel (training's core).

    The sink logits join as one more key, of zeros, whose column of the additive mask holds b_i:
    its score is then b_i for every query, and its value adds nothing (a third faster than
    ``eager_core`` in training here).
    """
    gqa = k.shape[1] != q.shape[1]
    if sink_logits is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    (B, h_kv, L, d), h = k.shape, q.shape[1]
    k = torch.cat([k.new_zeros(B, h_kv, 1, d), k], dim=2)  # (B, h_kv, L, d) -> (B, h_kv, 1 + L, d)
    v = torch.cat([v.new_zeros(B, h_kv, 1, d), v], dim=2)
    causal = torch.zeros(L, L, dtype=q.dtype).masked_fill(~causal_mask(L), float("-inf"))
    mask = torch.cat([sink_logits.to(q.dtype)[:, None, None].expand(h, L, 1), causal.expand(h, L, L)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # mask (h, L, 1 + L)


def attention_weights(scores: torch.Tensor, allowed: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """softmax over the ``allowed`` scores (B, h, L_q, L_k); with sink logits (h,), over one more column
    holding b_i, dropped after, so a row sums to less than 1."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink_logits is None:
        return torch.softmax(scores, dim=-1)
    sink = sink_logits.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)  # (B, h, L_q, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink column dropped


def eager_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink_logits: torch.Tensor | None,
               mask: torch.Tensor | None = None, weights_out: list | None = None, **_: object) -> torch.Tensor:
    r"""Attention step by step, with the sink column when ``sink_logits`` is given.

    .. math:: A_{mn} = \frac{e^{s_{mn}}}{[e^{b_i}] + \sum_k e^{s_{mk}}}, \quad s = QK^\top/\sqrt{d}

    ``mask`` (L_q, L_k) boolean, True = may attend; causal (bottom-right) when None. The weights
    (B, h, L_q, L_k), sink column dropped, are appended to ``weights_out`` when given.
    """
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # (B, h_kv, L_k, d) -> (B, h, L_k, d): head i reads i // n_rep
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, L_q, L_k)
    if mask is None:
        L_q, L_k = scores.shape[-2:]
        mask = causal_mask(L_q, L_k=L_k)
    weights = attention_weights(scores, mask, sink_logits)
    if weights_out is not None:
        weights_out.append(weights.detach())
    return weights @ v  # (B, h, L_q, L_k) @ (B, h, L_k, d) -> (B, h, L_q, d)


class Block(nn.Module):
    """One pre-norm block: attention (``MultiHeadAttention`` + RoPE) and a GELU MLP, each residual."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm_attn = nn.RMSNorm(cfg.d_model)
        self.attn = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, causal=True)
        self.sink_logits = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.sink_logit else None
        self.norm_mlp = nn.RMSNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, core: Core, layer: int) -> torch.Tensor:
        q, k, v = self.attn.project_qkv(self.norm_attn(x))  # (B, h, L, d), (B, h_kv, L, d) twice
        q = rotate(q, positions, rope.freqs) * rope.attention_factor
        k = rotate(k, positions, rope.freqs) * rope.attention_factor
        z = core(q, k, v, self.sink_logits, layer=layer, rope=rope)  # (B, h, L, d)
        x = x + self.attn.project_out(z)
        return x + self.mlp(self.norm_mlp(x))


def pool_kv_heads(model: ByteLM, num_kv_heads: int) -> ByteLM:
    r"""A copy of ``model`` with its K/V heads mean-pooled into ``num_kv_heads``.

    The GQA paper's conversion: adjacent heads gn .. gn + n - 1 (n = h_kv / h_kv')
    become head g, so query head i still reads the pool of the head it read.

    .. math:: W_K'^{(g)} = \frac{1}{n} \sum_{j < n} W_K^{(gn + j)},
              \quad \text{likewise } W_V

    Shapes: W_K, W_V (d_model, h_kv d_k) -> (d_model, h_kv' d_k).
    """
    cfg = model.cfg
    if num_kv_heads < 1 or cfg.num_kv_heads % num_kv_heads:
        raise ValueError(f"{cfg.num_kv_heads} K/V heads cannot be pooled evenly "
                         f"into {num_kv_heads}")
    n, d_k = cfg.num_kv_heads // num_kv_heads, cfg.head_dim
    arrays = model.state_arrays(np.float32)
    for name in [k for k in arrays if k.endswith(("attn.W_K", "attn.W_V"))]:
        W = arrays[name]
        # (d_model, h_kv d_k) -> (d_model, h_kv', n, d_k) -> (d_model, h_kv' d_k)
        grouped = W.reshape(W.shape[0], num_kv_heads, n, d_k)
        arrays[name] = grouped.mean(axis=2).reshape(W.shape[0], num_kv_heads * d_k)
    pooled = ByteLM(Config(**{**cfg.as_dict(), "num_kv_heads": num_kv_heads}))
    return pooled.load_arrays(arrays).eval()


class ByteLM(nn.Module):
    """Byte-level decoder: embedding, ``num_layers`` blocks, a final RMSNorm and the tied output matrix.

    ``forward(tokens)`` returns logits (B, L, VOCAB); ``rope`` and ``core`` default to plain RoPE
    and causal attention.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        if cfg.d_model % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
            raise ValueError(f"need d_model % num_heads == 0, num_heads % num_kv_heads == 0 and an even head "
                             f"size, got {cfg}")
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.plain_rope = Rope.plain(cfg.head_dim, cfg.rope_base)

    def forward(self, tokens: torch.Tensor, rope: Rope | None = None, core: Core = causal_core,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) int64 tokens -> (B, L, VOCAB) logits."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, L), got shape {tuple(tokens.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= VOCAB:
            raise ValueError(f"tokens must lie in 0..{VOCAB - 1}")
        rope = self.plain_rope if rope is None else rope
        positions = torch.arange(tokens.shape[1]) if positions is None else positions
        x = self.embed(tokens)  # (B, L) -> (B, L, d_model)
        for i, block in enumerate(self.blocks):
            x = block(x, positions, rope, core, i)
        return self.norm(x) @ self.embed.weight.T  # (B, L, d_model) @ (d_model, VOCAB)

    def loss(self, tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
        """Mean cross-entropy (nats per byte) of predicting tokens[:, 1:] from tokens[:, :-1]."""
        logits = self(tokens[:, :-1], **kwargs)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def state_arrays(self, dtype: np.dtype = np.float16) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays of ``dtype`` (what ``np.savez`` stores)."""
        return {n: p.detach().numpy().astype(dtype) for n, p in self.named_parameters()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> ByteLM:
        """Load ``state_arrays`` (any float dtype; held in float32); names and shapes must match."""
        params = dict(self.named_parameters())
        if set(arrays) != set(params):
            raise ValueError(f"weights do not match the model: missing {sorted(set(params) - set(arrays))}, "
                             f"unexpected {sorted(set(arrays) - set(params))}")
        with torch.no_grad():
            for n, p in params.items():
                if tuple(arrays[n].shape) != tuple(p.shape):
                    raise ValueError(f"{n} has shape {arrays[n].shape}, the model expects {tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.asarray(arrays[n], dtype=np.float32)))
        return self
