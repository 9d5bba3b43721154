"""FLOPs, memory and KV-cache sizes of attention, and the configurations of real models.

Conventions: a multiply-add is 2 FLOPs; softmax costs 5 FLOPs per score element by default
(subtract max, exp, sum, divide, plus the scale: the convention of the deep-dive seed).
Another convention, 4 for softmax plus 2 for scale and mask, is ``softmax_flops=6``.
Bytes are bytes; the helpers ``gib``/``gb`` convert with 2**30 and 10**9 respectively.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "flops_breakdown", "count_flops", "backward_flops_breakdown", "count_backward_flops", "memory_breakdown",
    "count_memory_bytes", "dtype_bytes", "DType", "ModelConfig", "MODEL_CONFIGS", "DEEPSEEK_V2",
    "kv_elements_per_token", "kv_cache_bytes", "decode_step_cost",
    "GPU_PEAKS", "gib", "gb", "DECODE_VARIANTS", "decode_attention_intensity", "serving_step_cost",
    "roofline_seconds",
]

DType: TypeAlias = "str | np.dtype | type[np.generic] | torch.dtype"  # a NumPy or torch dtype, or its name

_EXTRA_DTYPES = {"bfloat16": 2, "bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1, "float8": 1}


def dtype_bytes(dtype: DType) -> int:
    """Bytes per element of a NumPy dtype, a torch dtype or a name such as "float16" or "bfloat16"."""
    name = str(dtype).removeprefix("torch.")
    if name in _EXTRA_DTYPES:
        return _EXTRA_DTYPES[name]
    for candidate in (dtype, name):  # a NumPy dtype or type, then a torch dtype's name
        try:
            return np.dtype(candidate).itemsize
        except TypeError:
            pass
    raise ValueError(f"unknown dtype {dtype!r}")


def _check_dims(seq_len: int, d_model: int, n_heads: int, n_kv_heads: int) -> int:
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return d_model // n_heads


def _pairs(seq_len: int, causal: bool) -> int:
    """(query, key) pairs attention computes per head: :math:`L^2`, or :math:`L(L+1)/2` when causal."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def flops_breakdown(batch_size: int, seq_len: int, d_model: int, n_heads: int,
                    n_kv_heads: int | None = None, softmax_flops: int = 5, causal: bool = False) -> dict[str, int]:
    r"""Forward FLOPs of one attention layer, by component.

    ======== =========================== =====================
    proj_q   :math:`2BLd^2`              Q projection
    proj_kv  :math:`2 \cdot 2BLd\,(g d_k)` K and V (g = n_kv_heads)
    qk       :math:`2BhL^2d_k`           scores, = :math:`2BL^2d`
    softmax  :math:`c\,BhL^2`            c = softmax_flops
    av       :math:`2BhL^2d_k`           weighted values
    proj_o   :math:`2BLd^2`              output projection
    ======== =========================== =====================

    ``causal`` counts only the :math:`L(L+1)/2` (query, key) pairs on or below the diagonal in
    the :math:`L^2` terms: what a kernel that skips masked work computes (one that skips whole
    masked blocks computes slightly more, the diagonal blocks in full).
    """
    B, L, d, h = batch_size, seq_len, d_model, n_heads
    g = n_heads if n_kv_heads is None else n_kv_heads
    d_k = _check_dims(L, d, h, g)
    P = _pairs(L, causal)
    return {
        "proj_q": 2 * B * L * d * d,
        "proj_kv": 2 * 2 * B * L * d * (g * d_k),
        "qk": 2 * B * h * P * d_k,
        "softmax": softmax_flops * B * h * P,
        "av": 2 * B * h * P * d_k,
        "proj_o": 2 * B * L * d * d,
    }


def count_flops(batch_size: int, seq_len: int, d_model: int, n_heads: int,
                n_kv_heads: int | None = None, softmax_flops: int = 5, causal: bool = False) -> int:
    r"""Total forward FLOPs: :math:`8BLd^2 + 4BL^2d + 5BhL^2` for MHA (the sum of ``flops_breakdown``)."""
    return sum(flops_breakdown(batch_size, seq_len, d_model, n_heads, n_kv_heads, softmax_flops, causal).values())


def backward_flops_breakdown(batch_size: int, seq_len: int, d_model: int, n_heads: int,
                             n_kv_heads: int | None = None, softmax_flops: int = 5,
                             causal: bool = False) -> dict[str, int]:
    r"""Backward FLOPs of one attention layer, by the forward component they differentiate.

    Every forward product :math:`Y = AB` costs two products of its size backward
    (:math:`\nabla_A = \nabla_Y B^\top`, :math:`\nabla_B = A^\top \nabla_Y`), so each matmul term
    doubles. The softmax backward :math:`A \odot (\nabla_A - \operatorname{rowsum}(\nabla_A \odot A))`
    and the scale cost ``softmax_flops`` per score (default 5: product, row sum, subtraction,
    product, scale). For MHA the total is :math:`16BLd^2 + 8BL^2d + 5BhL^2` (seed 003's
    :math:`16BSD^2 + 8BS^2D + O(BN_HS^2)`). ``causal`` as in ``flops_breakdown``.
    """
    forward = flops_breakdown(batch_size, seq_len, d_model, n_heads, n_kv_heads, softmax_flops, causal)
    return {name: flops if name == "softmax" else 2 * flops for name, flops in forward.items()}


def count_backward_flops(batch_size: int, seq_len: int, d_model: int, n_heads: int,
                         n_kv_heads: int | None = None, softmax_flops: int = 5, causal: bool = False) -> int:
    r"""Total backward FLOPs: :math:`16BLd^2 + 8BL^2d + 5BhL^2` for MHA (the sum of ``backward_flops_breakdown``)."""
    return sum(backward_flops_breakdown(batch_size, seq_len, d_model, n_heads, n_kv_heads, softmax_flops,
                                        causal).values())


def memory_breakdown(batch_size: int, seq_len: int, d_model: int, n_heads: int, dtype: DType = "float64",
                     n_kv_heads: int | None = None) -> dict[str, int]:
    r"""Bytes of what the forward caches for the backward, by tensor (the layer's ``_cache``).

    Input X: :math:`BLd`; Q: :math:`BLd`; K, V: :math:`2BL g d_k`; attention weights A:
    :math:`BhL^2`; merged heads (concat): :math:`BLd`; times the element size. The per-head
    outputs Z are not kept: the backward needs only their merged copy, for :math:`\nabla_{W_O}`.
    """
    B, L, d, h = batch_size, seq_len, d_model, n_heads
    g = n_heads if n_kv_heads is None else n_kv_heads
    d_k = _check_dims(L, d, h, g)
    size = dtype_bytes(dtype)
    return {
        "x": B * L * d * size,
        "q": B * L * d * size,
        "kv": 2 * B * L * g * d_k * size,
        "attention_weights": B * h * L * L * size,
        "concat": B * L * d * size,
    }


def count_memory_bytes(batch_size: int, seq_len: int, d_model: int, n_heads: int, dtype: DType = "float64",
                       n_kv_heads: int | None = None) -> int:
    r"""Bytes a fused forward caches for backward: :math:`(5BLd + BhL^2)` elements for MHA (X, Q, K, V, A, concat)."""
    return sum(memory_breakdown(batch_size, seq_len, d_model, n_heads, dtype, n_kv_heads).values())


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a model: enough to size its FLOPs and its KV cache.

    A model with multi-head latent attention (MLA) also gives ``kv_latent_dim`` (:math:`d_c`) and
    ``rope_head_dim`` (:math:`d^R_h`): it caches those, not its heads' keys and values.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    max_context: int | None = None  # the longest context the model was trained for, in tokens
    kv_latent_dim: int | None = None  # MLA's d_c
    rope_head_dim: int | None = None  # MLA's decoupled RoPE key d_h^R

    @property
    def kind(self) -> str:
        """ "MLA" with a latent, else "MHA", "MQA" or "GQA" from the ratio of query to key/value heads."""
        if self.kv_latent_dim is not None:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"


MODEL_CONFIGS: dict[str, ModelConfig] = {c.name: c for c in [
    ModelConfig("GPT-2 small", n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, head_dim=64, max_context=1024),
    ModelConfig("GPT-2 XL", n_layers=48, d_model=1600, n_heads=25, n_kv_heads=25, head_dim=64, max_context=1024),
    ModelConfig("GPT-3 175B", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, head_dim=128,
                max_context=2048),
    ModelConfig("Llama-2-7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, head_dim=128,
                max_context=4096),
    ModelConfig("Llama-2-70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
                max_context=4096),
    ModelConfig("Llama-3-8B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                max_context=8192),
    ModelConfig("Mistral-7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                sliding_window=4096, max_context=8192),
]}


# DeepSeek-V2 (arXiv 2405.04434, section 3.1 and Table 1): 60 layers, 128 heads of 128, d_c = 512,
# d_h^R = 64, 128K context. Kept apart from MODEL_CONFIGS: its heads are not d_model wide in all
# (128 * 128 != 5120) and its cache is not 2 K/V heads per layer.
DEEPSEEK_V2 = ModelConfig("DeepSeek-V2", n_layers=60, d_model=5120, n_heads=128, n_kv_heads=128, head_dim=128,
                          max_context=131072, kv_latent_dim=512, rope_head_dim=64)


GPU_PEAKS: dict[str, tuple[float, float]] = {
    # datasheet peaks: dense 16-bit tensor-core FLOP/s, and memory bandwidth in bytes/s
    "A100 SXM 80GB": (312e12, 2.039e12),
    "H100 SXM": (989e12, 3.35e12),
}


def kv_elements_per_token(config: ModelConfig) -> int:
    r"""Numbers cached per token and layer: :math:`2 g d_k` (one K and one V per K/V head), or
    :math:`d_c + d^R_h` for MLA (the latent and the shared RoPE key)."""
    if config.kv_latent_dim is not None:
        if config.rope_head_dim is None:
            raise ValueError(f"{config.name} has kv_latent_dim but no rope_head_dim")
        return config.kv_latent_dim + config.rope_head_dim
    return 2 * config.n_kv_heads * config.head_dim


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch_size: int = 1, dtype: DType = "float16") -> int:
    r"""Bytes of the key/value cache: ``kv_elements_per_token`` :math:`\cdot\, n_{layers} \cdot L \cdot B` elements.

    Without a latent that is :math:`2 \cdot n_{layers} \cdot g \cdot d_k \cdot L \cdot B`: one K and one V
    per layer. A model with a sliding window keeps at most
    ``sliding_window`` positions (a rolling buffer), so its cache stops growing there.
    """
    if seq_len < 0 or batch_size < 1:
        raise ValueError(f"seq_len must be >= 0 and batch_size >= 1, got {seq_len} and {batch_size}")
    positions = seq_len if config.sliding_window is None else min(seq_len, config.sliding_window)
    return kv_elements_per_token(config) * config.n_layers * positions * batch_size * dtype_bytes(dtype)


def decode_step_cost(d_model: int, n_heads: int, n_kv_heads: int, context_len: int, batch_size: int = 1,
                     dtype: DType = "float16", softmax_flops: int = 5) -> dict[str, int]:
    r"""FLOPs done and bytes read by one decoding step of one attention layer: one new token per sequence
    against ``context_len`` cached positions (the new one included).

    ============= ========================================= ===========================
    proj_flops    :math:`2B(2d^2 + 2d\,g d_k)`              Q, K, V, O for one token
    attn_flops    :math:`4Bh\,t\,d_k + c\,Bh\,t`           scores, weighted values, softmax
    weight_bytes  :math:`(2d^2 + 2d\,g d_k)\,s`             read once, shared by the batch
    cache_bytes   :math:`2B\,g\,t\,d_k\,s`                 every sequence's K and V
    ============= ========================================= ===========================

    with :math:`t` = ``context_len``, :math:`g` = ``n_kv_heads`` and :math:`s` bytes per
    element. The token's own activations (a few :math:`Bd` vectors) are left out.
    """
    B, t, d, h, g = batch_size, context_len, d_model, n_heads, n_kv_heads
    d_k = _check_dims(t, d, h, g)
    s = dtype_bytes(dtype)
    weights = 2 * d * d + 2 * d * g * d_k  # W_Q, W_O: d x d; W_K, W_V: d x g d_k
    return {
        "proj_flops": 2 * B * weights,
        "attn_flops": 4 * B * h * t * d_k + softmax_flops * B * h * t,
        "weight_bytes": weights * s,
        "cache_bytes": 2 * B * g * t * d_k * s,
    }


DECODE_VARIANTS = ("cached K/V", "MLA absorbed", "MLA rebuilt")
"""How a decoding step's attention meets its cache: ``cached K/V`` (MHA, GQA, MQA: h_kv keys and values per
token), ``MLA absorbed`` (W_UK in the query, W_UV after the weighted latent) and ``MLA rebuilt`` (every head's
key and value up-projected from each cached latent at every step)."""


def decode_attention_intensity(config: ModelConfig, dtype: DType = "float16", variant: str = "cached K/V",
                               softmax_flops: int = 5) -> float:
    r"""FLOPs per byte of cache of a decoding step's attention, per cached token (the same for any context and batch).

    ============ ======================================================= ==========================
    cached K/V   :math:`4hd_k + ch`                                      :math:`2h_{kv}d_k\,s`
    MLA absorbed :math:`2h(d_c + d_R) + 2hd_c + ch`                      :math:`(d_c + d_R)\,s`
    MLA rebuilt  :math:`4hd_cd_k + 2h(d_k + d_R) + 2hd_k + ch`           :math:`(d_c + d_R)\,s`
    ============ ======================================================= ==========================

    FLOPs over bytes: scores and weighted values (2 per multiply-add), ``softmax_flops`` c per score; the
    absorbed MLA scores each latent against h queries of d_c + d_R and sums h weighted latents, the rebuilt one
    first up-projects the latent to h keys and h values. Without the softmax, cached K/V gives
    :math:`2(h/h_{kv})/s`. The query's own projections are left out (they do not grow with the context).
    """
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant must be one of {DECODE_VARIANTS}, got {variant!r}")
    h, d_k, s = config.n_heads, config.head_dim, dtype_bytes(dtype)
    if variant == "cached K/V":
        return (4 * h * d_k + softmax_flops * h) / (2 * config.n_kv_heads * d_k * s)
    if config.kv_latent_dim is None or config.rope_head_dim is None:
        raise ValueError(f"{config.name} has no latent: {variant} needs kv_latent_dim and rope_head_dim")
    d_c, d_r = config.kv_latent_dim, config.rope_head_dim
    flops = 2 * h * (d_c + d_r) + 2 * h * d_c + softmax_flops * h  # absorbed: h queries of d_c + d_R, h sums
    if variant == "MLA rebuilt":
        flops = 4 * h * d_c * d_k + 2 * h * (d_k + d_r) + 2 * h * d_k + softmax_flops * h
    return flops / ((d_c + d_r) * s)


def serving_step_cost(config: ModelConfig, n_params: float, chunks: Sequence[tuple[int, int]],
                      dtype: DType = "bfloat16") -> dict[str, float]:
    r"""FLOPs and bytes of one engine step of a whole model, for chunks of (n new tokens, ending at position c).

    ============= ====================================================================
    weight_flops  :math:`2 P \sum n`: every new token through every weight
    attn_flops    :math:`4 n_{layers} h d_k \sum (n c - n(n-1)/2)`: causal scores and values
    weight_bytes  :math:`P s`: the weights read once, shared by the step's tokens
    cache_bytes   :math:`2 n_{layers} h_{kv} d_k s \sum (c + n)`: each chunk reads its context, writes its new
    ============= ====================================================================

    with P = ``n_params`` and s bytes per element. Decoding is a chunk with n = 1.
    """
    if any(n < 1 or c < n for n, c in chunks):
        raise ValueError(f"every chunk needs 1 <= new <= context, got {list(chunks)}")
    s, L = dtype_bytes(dtype), config.n_layers
    per_position = kv_elements_per_token(config) * L * s  # one position's cache, every layer
    return {
        "weight_flops": 2 * n_params * sum(n for n, _ in chunks),
        "attn_flops": 4 * L * config.n_heads * config.head_dim * sum(n * c - n * (n - 1) / 2 for n, c in chunks),
        "weight_bytes": n_params * s,
        "cache_bytes": per_position * sum(c + n for n, c in chunks),
    }


def roofline_seconds(flops: float, n_bytes: float, peak_flops: float, peak_bytes_per_second: float) -> float:
    """The roofline's time for a piece of work: the slower of its arithmetic and its memory traffic at the peaks."""
    return max(flops / peak_flops, n_bytes / peak_bytes_per_second)


def gib(n_bytes: float) -> float:
    """Bytes to GiB (2**30 bytes)."""
    return n_bytes / 2**30


def gb(n_bytes: float) -> float:
    """Bytes to GB (10**9 bytes)."""
    return n_bytes / 1e9
