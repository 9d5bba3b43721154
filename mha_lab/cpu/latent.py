r"""Multi-head latent attention (MLA, DeepSeek-V2) in NumPy: a KV cache of one latent per token.

Every token's keys and values are up-projections of one latent :math:`c = x W_{DKV}` of size
:math:`d_c`: :math:`k^C_i = c\,W_{UK,i}`, :math:`v_i = c\,W_{UV,i}` for head i. Positions enter
through a separate, **decoupled** RoPE part: a query part :math:`q^R_i` per head and one key
:math:`k^R` shared by all heads. Per token and layer the cache holds :math:`c` and :math:`k^R`,
:math:`d_c + d_R` numbers, against :math:`2 h d_k` for MHA.

Decoding never rebuilds the keys and values. W_UK is **absorbed** into the query, and the
attention-weighted latent goes through W_UV and then W_O:

.. math:: q^C_i \cdot (c_j W_{UK,i}) = (q^C_i W_{UK,i}^\top) \cdot c_j, \qquad
          \textstyle\sum_j a_{ij}\,(c_j W_{UV,i})\,W_{O,i} = \big((\sum_j a_{ij}\,c_j)\,W_{UV,i}\big)\,W_{O,i},

which holds because :math:`W_{UK,i}` sits between the query and the latent with nothing
position-dependent in between: that is why RoPE needs its own key. The value side could also be
regrouped into one matrix :math:`W_{UV,i} W_{O,i}` of :math:`d_c \times d_\text{model}` per head, but
that matrix has more numbers than the two together and costs more FLOPs per token whenever
:math:`d_k` is smaller than :math:`d_c` and :math:`d_\text{model}`, so it is not formed. The query is
not compressed here (DeepSeek-V2 compresses it too, to save activation memory in training, not cache).
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.attention import xavier_normal
from mha_lab.cpu.functional import (
    check_rank,
    create_causal_mask,
    merge_heads,
    scaled_dot_product_attention,
    softmax,
    split_heads,
)
from mha_lab.cpu.positions import apply_rope

__all__ = ["LatentCache", "LatentAttention"]


class LatentCache:
    """MLA's cache for one layer: latents (B, max_len, d_c) and RoPE keys (B, max_len, d_R), allocated once."""

    def __init__(self, batch_size: int, latent_dim: int, rope_dim: int, max_len: int, dtype=np.float64) -> None:
        self.c = np.zeros((batch_size, max_len, latent_dim), dtype=dtype)
        self.k_rope = np.zeros((batch_size, max_len, rope_dim), dtype=dtype)
        self.max_len, self.length = max_len, 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated: ``B * max_len * (d_c + d_R) * itemsize``."""
        return self.c.nbytes + self.k_rope.nbytes

    @property
    def latents(self) -> np.ndarray:
        """(B, t, d_c) view of the filled positions."""
        return self.c[:, : self.length]

    @property
    def rope_keys(self) -> np.ndarray:
        """(B, t, d_R) view of the filled positions, rotated at their absolute positions."""
        return self.k_rope[:, : self.length]

    def append(self, c: np.ndarray, k_rope: np.ndarray) -> None:
        """Write n new positions: c (B, n, d_c), k_rope (B, n, d_R)."""
        n = c.shape[1]
        if self.length + n > self.max_len:
            raise ValueError(f"latent cache is full: max_len={self.max_len}, {self.length} used, {n} more")
        self.c[:, self.length:self.length + n] = c
        self.k_rope[:, self.length:self.length + n] = k_rope
        self.length += n


class LatentAttention:
    r"""Multi-head latent attention: ``forward`` builds every head's keys and values (the uncompressed
    form); ``prefill`` and ``decode_step`` attend over the cached latents, W_UK absorbed into the query.

    .. math:: \mathrm{score}_{i}(m, n) = \frac{q^C_{i,m} \cdot k^C_{i,n} + (R_m q^R_{i,m}) \cdot (R_n k^R_n)}
              {\sqrt{d_k + d_R}}

    Shapes: W_DKV (d_model, d_c); W_UK, W_UV (d_c, h d_k); W_Q (d_model, h d_k);
    W_QR (d_model, h d_R); W_KR (d_model, d_R); W_O (h d_k, d_model). Forward only.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, latent_dim: int, rope_dim: int,
                 base: float = 10000.0, seed: int | None = None, dtype=np.float64) -> None:
        for name, n in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim),
                        ("latent_dim", latent_dim), ("rope_dim", rope_dim)):
            if n < 1:
                raise ValueError(f"{name} must be positive, got {n}")
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs), got {rope_dim}")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.latent_dim, self.rope_dim, self.base = latent_dim, rope_dim, base
        self.dtype = np.dtype(dtype)
        rng = np.random.default_rng(seed)
        hd, hr = num_heads * head_dim, num_heads * rope_dim
        shapes = {"W_DKV": (d_model, latent_dim), "W_UK": (latent_dim, hd), "W_UV": (latent_dim, hd),
                  "W_Q": (d_model, hd), "W_QR": (d_model, hr), "W_KR": (d_model, rope_dim), "W_O": (hd, d_model)}
        for name, (fan_in, fan_out) in shapes.items():
            setattr(self, name, xavier_normal(rng, fan_in, fan_out, self.dtype))

    def _rotate(self, x: np.ndarray, offset: int) -> np.ndarray:
        return apply_rope(x, np.arange(offset, offset + x.shape[-2]), "half", self.base).astype(self.dtype)

    def _check(self, X: np.ndarray) -> np.ndarray:
        check_rank("X", X, 3, "(B, L, d_model)")
        if X.shape[-1] != self.d_model:
            raise ValueError(f"X has d_model={X.shape[-1]} but the layer expects d_model={self.d_model}")
        return np.asarray(X, dtype=self.dtype)

    def queries(self, X: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The content and RoPE parts of the queries: (B, L, d_model) -> (B, h, L, d_k), (B, h, L, d_R)."""
        q_c = split_heads(X @ self.W_Q, self.num_heads)  # (B, L, h*d_k) -> (B, h, L, d_k)
        q_r = split_heads(X @ self.W_QR, self.num_heads)  # (B, L, h*d_R) -> (B, h, L, d_R)
        return q_c, self._rotate(q_r, offset)

    def compress(self, X: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """What the cache keeps: latents (B, L, d_c) and the shared RoPE key (B, L, d_R), rotated."""
        return X @ self.W_DKV, self._rotate(X @ self.W_KR, offset)

    def forward(self, X: np.ndarray, mask: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        """The uncompressed form: every head's K and V built from the latents. (B, L, d_model) -> same."""
        X = self._check(X)
        q_c, q_r = self.queries(X, offset)
        c, k_r = self.compress(X, offset)
        k_c = split_heads(c @ self.W_UK, self.num_heads)  # (B, L, h*d_k) -> (B, h, L, d_k)
        V = split_heads(c @ self.W_UV, self.num_heads)  # (B, L, h*d_k) -> (B, h, L, d_k)
        k_r = np.broadcast_to(k_r[:, None], (*k_c.shape[:3], self.rope_dim))  # (B, L, d_R) -> (B, h, L, d_R)
        Q = np.concatenate([q_c, q_r], axis=-1)  # (B, h, L, d_k + d_R)
        K = np.concatenate([k_c, k_r], axis=-1)  # (B, h, L, d_k + d_R)
        Z, _ = scaled_dot_product_attention(Q, K, V, mask)  # scale 1/sqrt(d_k + d_R); (B, h, L, d_k)
        return merge_heads(Z) @ self.W_O  # (B, h, L, d_k) -> (B, L, h*d_k) -> (B, L, d_model)

    def head_projections(self) -> tuple[np.ndarray, np.ndarray]:
        """W_UK per head for the query, (h, d_k, d_c), and W_UV per head for the weighted latent, (h, d_c, d_k)."""
        h, d_k, d_c = self.num_heads, self.head_dim, self.latent_dim
        W_UK = self.W_UK.reshape(d_c, h, d_k).transpose(1, 2, 0)  # (d_c, h*d_k) -> (h, d_k, d_c)
        W_UV = self.W_UV.reshape(d_c, h, d_k).transpose(1, 0, 2)  # (d_c, h*d_k) -> (h, d_c, d_k)
        return W_UK, W_UV

    def _attend_latent(self, X: np.ndarray, cache: LatentCache, offset: int,
                       mask: np.ndarray | None) -> np.ndarray:
        """X's queries against the cached latents: (B, L, d_model) -> same."""
        W_UK, W_UV = self.head_projections()  # (h, d_k, d_c), (h, d_c, d_k)
        q_c, q_r = self.queries(X, offset)  # (B, h, L, d_k), (B, h, L, d_R)
        q_lat = q_c @ W_UK  # (B, h, L, d_k) @ (h, d_k, d_c) -> (B, h, L, d_c)
        c = cache.latents[:, None]  # (B, t, d_c) -> (B, 1, t, d_c): shared by the heads
        k_r = cache.rope_keys[:, None]  # (B, t, d_R) -> (B, 1, t, d_R)
        scores = q_lat @ c.swapaxes(-1, -2) + q_r @ k_r.swapaxes(-1, -2)  # (B, h, L, t)
        scores /= np.sqrt(self.head_dim + self.rope_dim)
        if mask is not None:
            scores += mask
        o_lat = softmax(scores) @ c  # (B, h, L, t) @ (B, 1, t, d_c) -> (B, h, L, d_c)
        Z = o_lat @ W_UV  # (B, h, L, d_c) @ (h, d_c, d_k) -> (B, h, L, d_k)
        return merge_heads(Z) @ self.W_O  # (B, L, h*d_k) @ W_O -> (B, L, d_model)

    def new_cache(self, batch_size: int, max_len: int) -> LatentCache:
        """An empty cache for this layer: ``(d_c + d_R) * max_len * batch_size`` numbers."""
        return LatentCache(batch_size, self.latent_dim, self.rope_dim, max_len, self.dtype)

    def prefill(self, X: np.ndarray, cache: LatentCache) -> np.ndarray:
        """Cache the prompt's latents and RoPE keys, attend causally over them: (B, L, d_model) -> same."""
        X = self._check(X)
        if cache.length:
            raise ValueError(f"prefill needs an empty cache, this one holds {cache.length} positions")
        cache.append(*self.compress(X))
        return self._attend_latent(X, cache, 0, create_causal_mask(X.shape[1], self.dtype))

    def decode_step(self, x: np.ndarray, cache: LatentCache) -> np.ndarray:
        """One new token at position ``cache.length``: (B, 1, d_model) -> (B, 1, d_model)."""
        x = self._check(x)
        if x.shape[1] != 1:
            raise ValueError(f"decode_step takes one token per sequence, x (B, 1, d_model); got {x.shape}")
        offset = cache.length
        cache.append(*self.compress(x, offset))
        return self._attend_latent(x, cache, offset, None)
