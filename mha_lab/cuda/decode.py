r"""Autoregressive decoding with a KV cache, in PyTorch on any device.

The PyTorch twin of ``mha_lab.cpu.decode``, for ``mha_lab.cuda.MultiHeadAttention``:
``prefill`` runs the prompt and stores its keys and values, ``decode_step`` runs one new
token against them. The cache holds the layer's ``num_kv_heads`` key/value heads; the
attention is ``F.scaled_dot_product_attention`` with ``enable_gqa``, which shares each
key/value head with its group of query heads instead of repeating it.

.. math:: z_t = \mathrm{softmax}\Big(\frac{q_t K_{\le t}^\top}{\sqrt{d_k}}\Big) V_{\le t}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mha_lab import kv_cache
from mha_lab.cuda.attention import MultiHeadAttention, causal_mask

__all__ = ["KVCache", "prefill", "decode_step"]


class KVCache(kv_cache.KVCache):
    """A ``mha_lab.kv_cache.KVCache`` of PyTorch tensors: ``KVCache(B, h_kv, d_k, max_len=... or window=...,
    dtype=torch.float32, device=None)``."""

    zeros = staticmethod(torch.zeros)

    @classmethod
    def for_layer(cls, layer: MultiHeadAttention, batch_size: int, max_len: int | None = None,
                  window: int | None = None) -> KVCache:
        """An empty cache shaped for ``layer``'s key/value heads, head size, dtype and device."""
        return cls(batch_size, layer.num_kv_heads, layer.d_k, max_len=max_len, window=window,
                   dtype=layer.W_K.dtype, device=layer.W_K.device)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """As ``mha_lab.kv_cache.KVCache.append``; the cache keeps no autograd history."""
        super().append(*(t.detach() if isinstance(t, torch.Tensor) else t for t in (k, v)))


def _check_layer_and_cache(layer: MultiHeadAttention, x: torch.Tensor, cache: KVCache) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(f"x must be a tensor (B, L, d_model={layer.d_model}), got {getattr(x, 'shape', x)}")
    want = (x.shape[0], layer.num_kv_heads, cache.capacity, layer.d_k)
    if tuple(cache.k.shape) != want or cache.k.dtype != x.dtype or cache.k.device != x.device:
        raise ValueError(f"the cache holds {cache.k.dtype} keys of shape {tuple(cache.k.shape)} on {cache.k.device}, "
                         f"but x needs {x.dtype} of shape {want} (B, h_kv, capacity, d_k) on {x.device}; "
                         "build it with KVCache.for_layer(layer, batch_size, ...)")


@torch.no_grad()
def prefill(layer: MultiHeadAttention, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the prompt x (B, L, d_model) causally, store its keys and values; returns (B, L, d_model).

    The cache must be empty. With a windowed cache the prompt is masked to the window too.
    """
    _check_layer_and_cache(layer, x, cache)
    if cache.length:
        raise ValueError(f"prefill needs an empty cache, this one holds {cache.length} positions; "
                         "continue with decode_step")
    q, k, v = layer.project_qkv(x)  # (B, h, L, d_k), (B, h_kv, L, d_k), (B, h_kv, L, d_k)
    mask = causal_mask(x.shape[1], cache.window, x.device)  # (L, L), True = may attend
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=layer.n_rep > 1)  # (B, h, L, d_k)
    cache.append(k, v)
    return layer.project_out(z)


@torch.no_grad()
def decode_step(layer: MultiHeadAttention, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One new token per sequence, x (B, 1, d_model), against the cache; returns (B, 1, d_model).

    Its key and value are appended first, so the token sees itself. No mask is needed: the
    cache holds exactly the positions the token may see (all of them, or the last W).
    """
    _check_layer_and_cache(layer, x, cache)
    if x.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per sequence, x (B, 1, d_model); got shape "
                         f"{tuple(x.shape)}; run a prompt with prefill")
    q, k, v = layer.project_qkv(x)  # (B, h, 1, d_k), (B, h_kv, 1, d_k), (B, h_kv, 1, d_k)
    cache.append(k, v)
    z = F.scaled_dot_product_attention(q, cache.keys, cache.values, enable_gqa=layer.n_rep > 1)  # (B, h, 1, d_k)
    return layer.project_out(z)
