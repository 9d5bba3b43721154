r"""Multi-head attention as a PyTorch module, on CPU or CUDA, with three interchangeable cores.

The parameters follow the NumPy layer of ``mha_lab.cpu``: ``y = X @ W + b`` with ``W`` of
shape (in_features, out_features), not ``nn.Linear``'s transposed (out, in) layout, so a
NumPy layer's weights copy across with ``torch.from_numpy`` and no transpose.

The attention core :math:`\mathrm{softmax}(QK^\top/\sqrt{d_k} + M)\,V` is chosen by ``backend``:

* ``"eager"``: the explicit steps (scores, mask, softmax, weighted values) as tensor ops;
  it materialises the (B, h, L, L) weights and is the one to read;
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, which dispatches to a
  fused kernel (flash or memory-efficient on CUDA) and shares K/V heads with ``enable_gqa``;
* ``"triton"``: our flash-attention kernel, ``mha_lab.cuda.flash.flash_attention`` (CUDA
  tensors, or any tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # the NumPy layer is only named in annotations: cuda never imports cpu
    from mha_lab.cpu import GroupedQueryAttention

__all__ = ["MultiHeadAttention", "BACKENDS", "attention_ref", "causal_mask", "torch_multihead_attention"]

BACKENDS = ("eager", "sdpa", "triton")
_NAMES = ("Q", "K", "V", "O")


def causal_mask(L: int, window: int | None = None, device: torch.device | str | None = None,
                L_k: int | None = None) -> torch.Tensor:
    """(L, L_k) boolean, True where query i may attend to key j: j <= i, and i - j < W with a ``window``.

    ``L_k`` defaults to L. With L_k != L the mask is aligned bottom-right, as in FlashAttention and
    decoding with a KV cache: query i stands at position i + L_k - L. (``F.scaled_dot_product_attention``
    with ``is_causal=True`` aligns it top-left instead.)
    """
    L_k = L if L_k is None else L_k
    i = torch.arange(L_k - L, L_k, device=device)[:, None]  # (L, 1): the queries' positions among the keys
    j = torch.arange(L_k, device=device)[None, :]  # (1, L_k)
    return (j <= i) if window is None else (j <= i) & (i - j < window)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None, upcast: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
    r"""Attention step by step in plain PyTorch, materialising the scores: the "eager" backend's core and
    the Triton kernel's reference (NumPy's is ``mha_lab.cpu.scaled_dot_product_attention``).

    .. math:: O = \mathrm{softmax}\big(s\,QK^\top + M\big)\,V, \quad s = 1/\sqrt{D} \text{ by default}

    Memory traffic: the (B, H, L, L) scores are written, read by the softmax, written again
    as probabilities and read by the second matmul. ``mask`` is boolean (True = may attend) or
    additive, broadcastable to (B, H, L, L); ``causal`` adds the causal mask. ``upcast=True``
    computes in float32 (float64 stays float64) and returns the input dtype: the accuracy
    yardstick for fp16/bf16; ``upcast=False`` computes in the input dtype, as plain PyTorch does.

    Shapes: q (B, H, L, D); k, v (B, H_kv, L_k, D) with H % H_kv == 0 -> (B, H, L, D); with
    L_k != L the causal mask is aligned bottom-right (see ``causal_mask``).
    """
    dtype = q.dtype
    if upcast and dtype != torch.float64:
        q, k, v = q.float(), k.float(), v.float()
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # (B, H_kv, L_k, D) -> (B, H, L_k, D): head h reads h // n_rep
    v = v.repeat_interleave(n_rep, dim=1)  # (B, H_kv, L_k, D) -> (B, H, L_k, D)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, L, D) @ (B, H, D, L_k) -> (B, H, L, L_k)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], device=q.device, L_k=k.shape[-2]), float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))  # True = may attend, so fill where False
    elif mask is not None:
        scores = scores + mask
    return (torch.softmax(scores, dim=-1) @ v).to(dtype)  # (B, H, L, L_k) @ (B, H, L_k, D) -> (B, H, L, D)


class MultiHeadAttention(nn.Module):
    r"""Multi-head (and grouped-/multi-query) self-attention with the NumPy layer's weight layout.

    .. math:: \mathrm{out} = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W_O + b_O, \quad
              \mathrm{head}_i = \mathrm{softmax}\Big(\frac{Q_i K_{g(i)}^\top}{\sqrt{d_k}} + M\Big) V_{g(i)}

    with :math:`Q = XW_Q + b_Q` (likewise K, V) and :math:`g(i) = i \,//\, (h / h_{kv})`:
    ``num_kv_heads=None`` is MHA, ``1`` is MQA, anything between is GQA.

    Shapes: W_Q, W_O: (d_model, d_model); W_K, W_V: (d_model, num_kv_heads * d_k);
    b_Q, b_O: (d_model,); b_K, b_V: (num_kv_heads * d_k,); d_k = d_model // num_heads.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, causal: bool = False,
                 bias: bool = False, backend: str = "sdpa", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if min(num_heads, num_kv_heads) < 1:
            raise ValueError(f"head counts must be positive, got num_heads={num_heads}, num_kv_heads={num_kv_heads}")
        for whole, part, whole_name, part_name in ((d_model, num_heads, "d_model", "num_heads"),
                                                   (num_heads, num_kv_heads, "num_heads", "num_kv_heads")):
            if whole % part:
                raise ValueError(f"{whole_name}={whole} is not divisible by {part_name}={part}")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.d_k = d_model // num_heads
        self.n_rep = num_heads // num_kv_heads  # query heads per K/V head
        self.causal, self.use_bias, self.backend = bool(causal), bool(bias), backend
        d_kv = num_kv_heads * self.d_k
        shapes = {"Q": (d_model, d_model), "K": (d_model, d_kv), "V": (d_model, d_kv), "O": (d_model, d_model)}
        factory = {"device": device, "dtype": dtype}
        for n, shape in shapes.items():
            setattr(self, f"W_{n}", nn.Parameter(torch.empty(shape, **factory)))
            setattr(self, f"b_{n}", nn.Parameter(torch.empty(shape[1], **factory)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        r"""Xavier normal weights, :math:`\sigma = \sqrt{2/(n_{in} + n_{out})}`, and zero biases, as in NumPy."""
        for n in _NAMES:
            nn.init.xavier_normal_(getattr(self, f"W_{n}"))
            if self.use_bias:
                nn.init.zeros_(getattr(self, f"b_{n}"))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"causal={self.causal}, bias={self.use_bias}, backend={self.backend!r}")

    @classmethod
    def from_numpy(cls, layer: GroupedQueryAttention, causal: bool = False, backend: str = "sdpa",
                   device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> MultiHeadAttention:
        """A module holding copies of a ``mha_lab.cpu`` MultiHeadAttention/GroupedQueryAttention's weights.

        The layouts agree, so each array goes through ``torch.from_numpy`` untransposed.
        ``dtype`` defaults to the layer's (float64 for the reference layer).
        """
        needed = ("d_model", "num_heads", "num_kv_heads", "use_bias", "parameters")
        missing = [a for a in needed if not hasattr(layer, a)]
        if missing:
            raise TypeError(f"from_numpy takes a mha_lab.cpu MultiHeadAttention or GroupedQueryAttention; "
                            f"{type(layer).__name__} lacks {missing}")
        params = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in layer.parameters().items()}
        module = cls(layer.d_model, layer.num_heads, layer.num_kv_heads, causal=causal, bias=layer.use_bias,
                     backend=backend, device=device, dtype=dtype or params["W_Q"].dtype)
        with torch.no_grad():
            for n, t in params.items():
                getattr(module, n).copy_(t)  # copy_ converts dtype and device
        return module

    def to_numpy(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays keyed like ``mha_lab.cpu`` layers' ``parameters()`` (W_Q ... b_O).

        Load them into a NumPy layer with ``for name, a in m.to_numpy().items(): setattr(layer, name, a)``.
        """
        return {name: p.detach().cpu().numpy().copy() for name, p in self.named_parameters()}

    def _project(self, x: torch.Tensor, n: str) -> torch.Tensor:
        """x @ W_n + b_n: (B, L, in_features) -> (B, L, out_features)."""
        y = x @ getattr(self, f"W_{n}")
        return y + getattr(self, f"b_{n}") if self.use_bias else y

    def project_qkv(self, x: torch.Tensor,
                    x_kv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values split into heads: steps 1-2 of ``forward``, for code that brings its
        own attention core (decoding with a KV cache). Keys and values come from ``x_kv`` when given.

        Shapes: x (B, L, d_model), x_kv (B, L_k, d_model) -> q (B, h, L, d_k); k, v (B, h_kv, L_k, d_k).
        """
        x_kv = x if x_kv is None else x_kv
        (B, L, _), L_k = x.shape, x_kv.shape[1]
        h, h_kv, d_k = self.num_heads, self.num_kv_heads, self.d_k
        q = self._project(x, "Q").view(B, L, h, d_k).transpose(1, 2)  # (B, L, d_model) -> (B, h, L, d_k)
        # (B, L_k, h_kv*d_k) -> (B, h_kv, L_k, d_k)
        k = self._project(x_kv, "K").view(B, L_k, h_kv, d_k).transpose(1, 2)
        v = self._project(x_kv, "V").view(B, L_k, h_kv, d_k).transpose(1, 2)
        return q, k, v

    def project_out(self, z: torch.Tensor) -> torch.Tensor:
        """Merge the heads and apply the output projection, steps 6-7: (B, h, L, d_k) -> (B, L, d_model)."""
        B, _, L, _ = z.shape
        z = z.transpose(1, 2).reshape(B, L, self.d_model)  # (B, h, L, d_k) -> (B, L, h, d_k) -> (B, L, d_model)
        return self._project(z, "O")

    def _check_input(self, x: torch.Tensor, name: str = "x") -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, L, d_model), got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must have rank 3 (B, L, d_model), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"{name} has d_model={x.shape[-1]} but the layer expects d_model={self.d_model}")
        if x.shape[1] < 1:
            raise ValueError(f"{name} has length 0: there is nothing to attend to")

    def _check_kv_input(self, x_kv: torch.Tensor, x: torch.Tensor) -> None:
        self._check_input(x_kv, "x_kv")
        if x_kv.shape[0] != x.shape[0]:
            raise ValueError(f"x_kv has batch size {x_kv.shape[0]} but x has {x.shape[0]}")
        if x_kv.device != x.device or x_kv.dtype != x.dtype:
            raise ValueError(f"x_kv ({x_kv.dtype} on {x_kv.device}) must match x ({x.dtype} on {x.device})")
        if self.causal and x_kv.shape[1] < x.shape[1]:
            raise ValueError(f"causal cross-attention needs L_k >= L_q, got L_k={x_kv.shape[1]} < L_q={x.shape[1]}: "
                             "the bottom-right causal mask would leave the first queries with no key")

    def _full_mask(self, attn_mask: torch.Tensor, x: torch.Tensor, L_k: int) -> torch.Tensor:
        """Validate ``attn_mask`` and fold the causal mask into it; reject rows with no allowed key."""
        B, L, _ = x.shape
        target = (B, self.num_heads, L, L_k)
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be boolean (True = may attend) or additive float, got {attn_mask.dtype}")
        try:
            broadcast = tuple(torch.broadcast_shapes(attn_mask.shape, target))
        except RuntimeError:
            broadcast = None
        if broadcast != target:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, h, L_q, L_k) {target}")
        if attn_mask.device != x.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but x is on {x.device}")
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(x.dtype)
        if self.causal:
            past = causal_mask(L, device=x.device, L_k=L_k)
            mask = mask & past if mask.dtype == torch.bool else mask.masked_fill(~past, float("-inf"))
        allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
        if not allowed.any(dim=-1).all():
            raise ValueError("attn_mask leaves a query with no key to attend to (a fully masked row); "
                             "True means 'may attend': is the mask inverted?")
        return mask

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, *,
                x_kv: torch.Tensor | None = None) -> torch.Tensor:
        r"""(B, L, d_model) -> (B, L, d_model).

        Self-attention by default; with ``x_kv`` (B, L_k, d_model), cross-attention: queries from
        ``x``, keys and values from ``x_kv``. ``attn_mask`` broadcasts to (B, h, L, L_k) and is either
        boolean, where **True means "may attend"** (as in ``F.scaled_dot_product_attention``), or an
        additive float mask (0 / -inf); a key-padding mask is (B, 1, 1, L_k). With ``causal=True`` it is
        combined with the causal mask, aligned bottom-right when L_k > L (query i at position
        i + L_k - L, as in FlashAttention; ``is_causal=True`` in PyTorch would align it top-left).
        A query left with no key raises ValueError. The triton backend takes no ``attn_mask``
        and needs L_k == L.
        """
        self._check_input(x)
        if x_kv is not None:
            self._check_kv_input(x_kv, x)
        L, L_k = x.shape[1], (x if x_kv is None else x_kv).shape[1]
        if attn_mask is not None:
            mask = self._full_mask(attn_mask, x, L_k)
        elif self.causal and L_k != L and self.backend != "triton":  # is_causal would align top-left
            mask = causal_mask(L, device=x.device, L_k=L_k)
        else:
            mask = None
        # 1. project with one GEMM each, then 2. split the feature axis into heads
        q, k, v = self.project_qkv(x, x_kv)  # (B, h, L, d_k), (B, h_kv, L_k, d_k), (B, h_kv, L_k, d_k)
        # 3.-5. scores, mask, softmax, weighted values
        if self.backend == "eager":
            z = attention_ref(q, k, v, causal=self.causal and mask is None, mask=mask, upcast=False)
        elif self.backend == "sdpa":
            z = self._sdpa_attention(q, k, v, mask)
        else:
            z = self._triton_attention(q, k, v, mask)
        # 6. merge the heads, then 7. the output projection
        return self.project_out(z)

    def _sdpa_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None) -> torch.Tensor:
        """PyTorch's fused attention; K/V heads are shared, not repeated, when h_kv < h."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                              enable_gqa=self.n_rep > 1)  # (B, h, L, d_k)

    def _triton_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """Our Triton flash kernel (imported here, so that the other backends never need Triton)."""
        if mask is not None:
            raise ValueError("the triton backend takes no attn_mask (only causal=True); use backend='sdpa'")
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(f"the triton kernel needs as many keys as queries, got L_k={k.shape[-2]} and "
                             f"L_q={q.shape[-2]}; use backend='sdpa' for cross-attention of different lengths")
        try:
            from mha_lab.cuda.flash import flash_attention
        except ImportError as err:
            raise RuntimeError(f"backend='triton' needs the triton package ({err}); use backend='sdpa'") from err
        return flash_attention(q, k, v, causal=self.causal)  # (B, h, L, d_k)


def torch_multihead_attention(layer: GroupedQueryAttention) -> nn.MultiheadAttention:
    """PyTorch's own ``nn.MultiheadAttention`` (batch first, the layer's dtype) holding a NumPy MHA layer's weights.

    It computes ``x @ W.T + b`` with Q, K, V stacked in ``in_proj_weight`` (3 d_model, d_model),
    so each of our (in, out) matrices goes in transposed; biases copy as they are.
    """
    if layer.num_kv_heads != layer.num_heads:
        raise ValueError(f"nn.MultiheadAttention has no grouped K/V heads: the layer has {layer.num_kv_heads} "
                         f"for {layer.num_heads} query heads")
    dtype = torch.from_numpy(layer.W_Q).dtype
    module = nn.MultiheadAttention(layer.d_model, layer.num_heads, bias=layer.use_bias, batch_first=True, dtype=dtype)
    with torch.no_grad():
        module.in_proj_weight.copy_(torch.from_numpy(np.concatenate([layer.W_Q, layer.W_K, layer.W_V], axis=1).T))
        module.out_proj.weight.copy_(torch.from_numpy(layer.W_O.T))
        if layer.use_bias:
            module.in_proj_bias.copy_(torch.from_numpy(np.concatenate([layer.b_Q, layer.b_K, layer.b_V])))
            module.out_proj.bias.copy_(torch.from_numpy(layer.b_O))
    return module
