r"""Autoregressive decoding with a KV cache, in NumPy.

A causal model never lets an old token see a new one, so the keys and values of past tokens
never change: ``prefill`` computes them once for the prompt and stores them in a ``KVCache``;
each ``decode_step`` then projects only the new token, appends its key and value, and
attends over the cache. The cache holds the layer's ``h_kv`` key/value heads, not the ``h``
query heads: that is what grouped- and multi-query attention save.

.. math:: z_t = \mathrm{softmax}\Big(\frac{q_t K_{\le t}^\top}{\sqrt{d_k}}\Big) V_{\le t}

The layer is a ``mha_lab.cpu`` ``GroupedQueryAttention`` (or ``MultiHeadAttention``, or
``RotaryAttention``, whose keys are cached already rotated at their absolute positions); its
projections are used through its public interface, and the attention itself is
``scaled_dot_product_attention`` with ``enable_gqa``.
"""

from __future__ import annotations

import numpy as np

from mha_lab import kv_cache
from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import check_rank, create_causal_mask, scaled_dot_product_attention

__all__ = ["KVCache", "prefill", "decode_step"]


class KVCache(kv_cache.KVCache):
    """A ``mha_lab.kv_cache.KVCache`` of NumPy arrays: ``KVCache(B, h_kv, d_k, max_len=... or window=...,
    dtype=np.float64)``."""

    zeros = staticmethod(np.zeros)

    @classmethod
    def for_layer(cls, layer: GroupedQueryAttention, batch_size: int, max_len: int | None = None,
                  window: int | None = None) -> KVCache:
        """An empty cache shaped for ``layer``'s key/value heads, head size and dtype."""
        return cls(batch_size, layer.num_kv_heads, layer.d_k, max_len=max_len, window=window, dtype=layer.dtype)


def _check_layer_and_cache(layer: GroupedQueryAttention, X: np.ndarray, cache: KVCache) -> None:
    check_rank("X", X, 3, "(B, L, d_model)")
    if X.shape[-1] != layer.d_model:
        raise ValueError(f"X has d_model={X.shape[-1]} but the layer expects d_model={layer.d_model}")
    want = (X.shape[0], layer.num_kv_heads, cache.capacity, layer.d_k)
    if cache.k.shape != want or cache.k.dtype != layer.dtype:
        raise ValueError(f"the cache holds {cache.k.dtype} keys of shape {cache.k.shape}, but this layer and "
                         f"batch need {layer.dtype} of shape {want} (B, h_kv, capacity, d_k); "
                         "build it with KVCache.for_layer(layer, batch_size, ...)")


def prefill(layer: GroupedQueryAttention, X: np.ndarray, cache: KVCache) -> np.ndarray:
    """Run the prompt X (B, L, d_model) causally, store its keys and values; returns (B, L, d_model).

    The cache must be empty. With a windowed cache the prompt is masked to the window too.
    """
    _check_layer_and_cache(layer, X, cache)
    if cache.length:
        raise ValueError(f"prefill needs an empty cache, this one holds {cache.length} positions; "
                         "continue with decode_step")
    Q, K, V = layer.project_qkv(X, offset=0)  # (B, h, L, d_k), (B, h_kv, L, d_k), (B, h_kv, L, d_k)
    mask = create_causal_mask(X.shape[1], layer.dtype, window=cache.window)  # (1, 1, L, L)
    Z, _ = scaled_dot_product_attention(Q, K, V, mask, enable_gqa=True)  # (B, h, L, d_k)
    cache.append(K, V)
    return layer.project_out(Z)


def decode_step(layer: GroupedQueryAttention, x: np.ndarray,
                cache: KVCache, offset: int | None = None) -> np.ndarray:
    """One new token per sequence against the cache.

    Shapes: x: (B, 1, d_model) -> (B, 1, d_model).

    Its key and value are appended first, so the token sees itself. No mask is
    needed: the cache holds exactly the positions the token may see (all, or the
    last W).

    ``offset`` is the token's absolute position, by default ``cache.length``
    (the positions seen so far); only a RoPE layer reads it. Code that tracks
    positions itself passes it, and must advance it by one per token.
    """
    _check_layer_and_cache(layer, x, cache)
    if x.shape[1] != 1:
        raise ValueError("decode_step takes one token per sequence, "
                         "x (B, 1, d_model); "
                         f"got shape {x.shape}; run a prompt with prefill")
    offset = cache.length if offset is None else offset
    # (B, h, 1, d_k), (B, h_kv, 1, d_k) twice
    q, k, v = layer.project_qkv(x, offset=offset)
    cache.append(k, v)
    # h query heads against h_kv cached heads: (B, h, 1, d_k)
    z, _ = scaled_dot_product_attention(q, cache.keys, cache.values, enable_gqa=True)
    return layer.project_out(z)  # (B, h, 1, d_k) -> (B, 1, d_model)
