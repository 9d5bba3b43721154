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

__all__ = ["KVCache", "prefill", "decode_step"]


class KVCache:
    """Keys and values of one attention layer: two (B, h_kv, capacity, d_k) tensors, allocated once.

    Without a ``window`` the cache holds ``max_len`` positions, and appending to a full cache
    raises ValueError. With a sliding ``window`` W (Mistral's) it is a rolling buffer of W
    slots: position p lives in slot ``p % W``, so each new token **evicts** the token W
    positions back, which the window no longer lets anyone see. Give exactly one of the two.

    ``length`` counts the positions written so far; ``keys`` and ``values`` are views of the
    filled slots, in slot order (attention does not depend on the order of the keys).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int | None = None,
                 window: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if (max_len is None) == (window is None):
            raise ValueError("give max_len (a full cache raises) or window (a rolling buffer that evicts), "
                             f"exactly one of them; got max_len={max_len}, window={window}")
        for name, n in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("max_len", max_len), ("window", window)):
            if n is not None and n < 1:
                raise ValueError(f"{name} must be at least 1, got {n}")
        self.max_len, self.window = max_len, window
        self.capacity = window if window is not None else max_len
        shape = (batch_size, num_kv_heads, self.capacity, head_dim)  # (B, h_kv, capacity, d_k)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_layer(cls, layer, batch_size: int, max_len: int | None = None, window: int | None = None) -> KVCache:
        """An empty cache shaped for ``layer``'s key/value heads, head size, dtype and device."""
        return cls(batch_size, layer.num_kv_heads, layer.d_k, max_len=max_len, window=window,
                   dtype=layer.W_K.dtype, device=layer.W_K.device)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V: ``2 * B * h_kv * capacity * d_k * element size``."""
        return self.k.nbytes + self.v.nbytes

    @property
    def keys(self) -> torch.Tensor:
        """(B, h_kv, n, d_k) view of the n = min(length, capacity) filled slots."""
        return self.k[:, :, : min(self.length, self.capacity)]

    @property
    def values(self) -> torch.Tensor:
        """(B, h_kv, n, d_k) view of the filled slots, paired with ``keys``."""
        return self.v[:, :, : min(self.length, self.capacity)]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the keys and values of n new positions, each (B, h_kv, n, d_k).

        Raises ValueError when a cache without a window has no room for them. A windowed
        cache keeps the last W and overwrites (evicts) the oldest.
        """
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError(f"k must be a tensor of rank 4 (B, h_kv, n, d_k), got {getattr(k, 'shape', k)}")
        want = self.k.shape[:2] + self.k.shape[3:]
        if k.shape != v.shape or k.shape[:2] + k.shape[3:] != want:
            raise ValueError(f"k and v must both have shape (B, h_kv, n, d_k) = {tuple(self.k.shape[:2])} + (n,) + "
                             f"{tuple(self.k.shape[3:])}; got {tuple(k.shape)} and {tuple(v.shape)}")
        n = k.shape[2]
        if self.window is None and self.length + n > self.max_len:
            raise ValueError(f"KV cache is full: it holds max_len={self.max_len} positions, {self.length} are "
                             f"used, and {n} more do not fit; allocate a larger cache or use a window")
        keep = min(n, self.capacity)  # a windowed prompt longer than W: only its last W are visible later
        slots = torch.arange(self.length + n - keep, self.length + n, device=self.k.device) % self.capacity
        self.k[:, :, slots] = k[:, :, n - keep:].detach()
        self.v[:, :, slots] = v[:, :, n - keep:].detach()
        self.length += n


def window_mask(seq_len: int, window: int | None, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, L) boolean, True where query i may attend to key j: j <= i, and i - j < W with a window."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (i - j < window)


def _check_layer_and_cache(layer, x: torch.Tensor, cache: KVCache) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != layer.d_model:
        raise ValueError(f"x must be a tensor (B, L, d_model={layer.d_model}), got {getattr(x, 'shape', x)}")
    want = (x.shape[0], layer.num_kv_heads, cache.capacity, layer.d_k)
    if tuple(cache.k.shape) != want or cache.k.dtype != x.dtype or cache.k.device != x.device:
        raise ValueError(f"the cache holds {cache.k.dtype} keys of shape {tuple(cache.k.shape)} on {cache.k.device}, "
                         f"but x needs {x.dtype} of shape {want} (B, h_kv, capacity, d_k) on {x.device}; "
                         "build it with KVCache.for_layer(layer, batch_size, ...)")


@torch.no_grad()
def prefill(layer, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the prompt x (B, L, d_model) causally, store its keys and values; returns (B, L, d_model).

    The cache must be empty. With a windowed cache the prompt is masked to the window too.
    """
    _check_layer_and_cache(layer, x, cache)
    if cache.length:
        raise ValueError(f"prefill needs an empty cache, this one holds {cache.length} positions; "
                         "continue with decode_step")
    q, k, v = layer.project_qkv(x)  # (B, h, L, d_k), (B, h_kv, L, d_k), (B, h_kv, L, d_k)
    mask = window_mask(x.shape[1], cache.window, x.device)  # (L, L), True = may attend
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=layer.n_rep > 1)  # (B, h, L, d_k)
    cache.append(k, v)
    return layer.project_out(z)


@torch.no_grad()
def decode_step(layer, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
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
