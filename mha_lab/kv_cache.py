"""The KV cache's bookkeeping, the same for NumPy and PyTorch: a full cache, or a rolling window.

``mha_lab.cpu.decode`` and ``mha_lab.cuda.decode`` subclass ``KVCache`` with their own buffers
(``zeros``); which slot each position takes, what a window evicts and when a cache is full
are decided here, once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of one attention layer: two (B, h_kv, capacity, d_k) buffers, allocated once.

    Without a ``window`` the cache holds ``max_len`` positions, and appending to a full cache
    raises ValueError. With a sliding ``window`` W (Mistral's) it is a rolling buffer of W
    slots: position p lives in slot ``p % W``, so each new token **evicts** the token W
    positions back, which the window no longer lets anyone see. Give exactly one of the two.

    ``length`` counts the positions written so far; ``keys`` and ``values`` are views of the
    filled slots, in slot order (attention does not depend on the order of the keys).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int | None = None,
                 window: int | None = None, **buffer: Any) -> None:
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
        self.k, self.v = self.zeros(shape, **buffer), self.zeros(shape, **buffer)
        self.length = 0

    @staticmethod
    def zeros(shape: tuple[int, ...], **buffer: Any) -> Any:
        """A zero buffer of ``shape`` in the subclass's array library (``buffer``: dtype, device...)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V: ``2 * B * h_kv * capacity * d_k * itemsize``."""
        return self.k.nbytes + self.v.nbytes

    @property
    def keys(self) -> Any:
        """(B, h_kv, n, d_k) view of the n = min(length, capacity) filled slots."""
        return self.k[:, :, : min(self.length, self.capacity)]

    @property
    def values(self) -> Any:
        """(B, h_kv, n, d_k) view of the filled slots, paired with ``keys``."""
        return self.v[:, :, : min(self.length, self.capacity)]

    def append(self, k: Any, v: Any) -> None:
        """Write the keys and values of n new positions, each (B, h_kv, n, d_k).

        Raises ValueError when a cache without a window has no room for them. A windowed
        cache keeps the last W and overwrites (evicts) the oldest.
        """
        if getattr(k, "ndim", None) != 4:
            raise ValueError(f"k must be an array of rank 4 (B, h_kv, n, d_k), got {getattr(k, 'shape', k)}")
        want = tuple(self.k.shape[:2] + self.k.shape[3:])
        if tuple(k.shape) != tuple(v.shape) or tuple(k.shape[:2] + k.shape[3:]) != want:
            raise ValueError(f"k and v must both have shape (B, h_kv, n, d_k) = {tuple(self.k.shape[:2])} + (n,) + "
                             f"{tuple(self.k.shape[3:])}; got {tuple(k.shape)} and {tuple(v.shape)}")
        n = k.shape[2]
        if self.window is None and self.length + n > self.max_len:
            raise ValueError(f"KV cache is full: it holds max_len={self.max_len} positions, {self.length} are "
                             f"used, and {n} more do not fit; allocate a larger cache or use a window")
        keep = min(n, self.capacity)  # a windowed prompt longer than W: only its last W are visible later
        slots = [p % self.capacity for p in range(self.length + n - keep, self.length + n)]
        self.k[:, :, slots] = k[:, :, n - keep:]
        self.v[:, :, slots] = v[:, :, n - keep:]
        self.length += n
