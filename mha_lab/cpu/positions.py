r"""Positional information for attention, in NumPy: what attention alone cannot see.

Attention is permutation-equivariant: shuffle the tokens and the outputs are shuffled the same
way. Positions enter in one of three places:

- added to the input: ``sinusoidal_encoding`` (fixed) or ``LearnedPositions`` (a trained table);
- rotating queries and keys: ``apply_rope`` (RoPE), so that :math:`q_m \cdot k_n` depends on
  :math:`n - m` only; ``RotaryAttention`` is a layer that does it, with a KV cache;
- biasing the scores: ``alibi_bias`` (ALiBi), :math:`-\alpha_i\,|m - n|` (head i, positions m and n) added like a mask.

RoPE comes in two layouts that pair different coordinates: ``"interleaved"`` rotates
:math:`(x_{2i}, x_{2i+1})` (the RoPE paper, GPT-J), ``"half"`` rotates :math:`(x_i, x_{i+d/2})`
(GPT-NeoX, Hugging Face Llama). They differ by a permutation of each head's coordinates, so a
checkpoint moves from one to the other by permuting the columns of W_Q and W_K
(``interleaved_to_half``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import scaled_dot_product_attention

__all__ = [
    "sinusoidal_encoding", "LearnedPositions", "rope_angles", "apply_rope", "rotate_pairs", "rotation_matrix",
    "interleaved_to_half", "RotaryAttention", "alibi_slopes", "alibi_bias",
]

Layout = Literal["interleaved", "half"]


def _check_even(d: int, what: str) -> None:
    if d < 2 or d % 2:
        raise ValueError(f"{what} must be even and at least 2 (coordinates are rotated in pairs), got {d}")


def sinusoidal_encoding(seq_len: int, d_model: int, base: float = 10000.0, offset: int = 0) -> np.ndarray:
    r"""The fixed encoding of "Attention is all you need", for positions ``offset .. offset+seq_len-1``.

    .. math:: PE_{p, 2i} = \sin(p\,\omega_i), \quad PE_{p, 2i+1} = \cos(p\,\omega_i),
              \quad \omega_i = \text{base}^{-2i/d}

    Shapes: -> (seq_len, d_model); added to the token embeddings (B, L, d_model).
    """
    _check_even(d_model, "d_model")
    angles = rope_angles(np.arange(offset, offset + seq_len), d_model, base)  # (L, d_model/2)
    pe = np.empty((seq_len, d_model))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angles), np.cos(angles)
    return pe


class LearnedPositions:
    """A trained table of ``max_len`` position vectors, added to the input (GPT-2's ``wpe``).

    It knows nothing past ``max_len``: a longer sequence is an error, not an extrapolation.
    Shapes: table (max_len, d_model); X (B, L, d_model) -> (B, L, d_model).
    """

    def __init__(self, max_len: int, d_model: int, seed: int | None = None, std: float = 0.02) -> None:
        self.max_len, self.d_model = max_len, d_model
        self.table = np.random.default_rng(seed).normal(0.0, std, size=(max_len, d_model))

    def __call__(self, X: np.ndarray, offset: int = 0) -> np.ndarray:
        """X plus the rows of positions ``offset .. offset+L-1``."""
        L = X.shape[-2]
        if X.shape[-1] != self.d_model:
            raise ValueError(f"X has d_model={X.shape[-1]} but the table has d_model={self.d_model}")
        if offset < 0 or offset + L > self.max_len:
            raise ValueError(f"positions {offset}..{offset + L - 1} are outside the learned table of "
                             f"max_len={self.max_len}: a learned encoding cannot extrapolate")
        return X + self.table[offset:offset + L]


def rope_angles(positions: np.ndarray, dim: int, base: float = 10000.0) -> np.ndarray:
    r"""Rotation angles :math:`\theta_{p,i} = p\,\text{base}^{-2i/d}` for i < d/2; (L,) -> (L, d/2)."""
    freqs = base ** (-np.arange(0, dim // 2) * 2.0 / dim)  # (d/2,), from 1 down to ~1/base
    return np.asarray(positions, dtype=np.float64)[:, None] * freqs  # (L, 1) * (d/2,) -> (L, d/2)


def _pairs(layout: Layout, dim: int) -> tuple[slice, slice]:
    """The two coordinates of each rotated pair: (2i, 2i+1) interleaved, (i, i + d/2) half."""
    if layout == "interleaved":
        return slice(0, dim, 2), slice(1, dim, 2)
    if layout == "half":
        return slice(0, dim // 2), slice(dim // 2, dim)
    raise ValueError(f"layout must be 'interleaved' or 'half', got {layout!r}")


def apply_rope(x: np.ndarray, positions: np.ndarray, layout: Layout = "half",
               base: float = 10000.0) -> np.ndarray:
    r"""Rotate each pair (a, b) of the vector at position p by :math:`\theta_{p,i}`.

    .. math:: x'_a = x_a \cos\theta - x_b \sin\theta, \quad
              x'_b = x_a \sin\theta + x_b \cos\theta

    Shapes: x (..., L, d) with d even, positions (L,) -> (..., L, d).
    ``layout`` sets the pairs (see the module docstring).
    """
    dim = x.shape[-1]
    _check_even(dim, "the head size")
    positions = np.asarray(positions)
    if positions.shape != (x.shape[-2],):
        raise ValueError(f"positions must have shape (L,) = ({x.shape[-2]},), "
                         f"got {positions.shape}")
    return rotate_pairs(x, rope_angles(positions, dim, base), layout)


def rotate_pairs(x: np.ndarray, angles: np.ndarray, layout: Layout = "half") -> np.ndarray:
    """Rotate pair i of the vector at row p by ``angles[p, i]``; RoPE's step once the angles are known.

    Shapes: x (..., L, d), angles (L, d/2) -> (..., L, d).
    """
    dim = x.shape[-1]
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = _pairs(layout, dim)
    out = np.empty(np.broadcast_shapes(x.shape, (x.shape[-2], dim)))
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., a] * sin + x[..., b] * cos
    return out


def rotation_matrix(position: float, dim: int, layout: Layout = "half", base: float = 10000.0) -> np.ndarray:
    r"""RoPE at one position as a (d, d) matrix :math:`R_p`: ``apply_rope(x, [p]) == x @ R_p.T``.

    Block-diagonal in the layout's pairs, orthogonal, and :math:`R_m^\top R_n = R_{n-m}`.
    """
    _check_even(dim, "the head size")
    theta = rope_angles(np.array([position]), dim, base)[0]  # (d/2,)
    a, b = (np.arange(dim)[s] for s in _pairs(layout, dim))
    R = np.zeros((dim, dim))
    R[a, a], R[a, b] = np.cos(theta), -np.sin(theta)
    R[b, a], R[b, b] = np.sin(theta), np.cos(theta)
    return R


def interleaved_to_half(W: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder each head's columns of a (d_in, num_heads * d_k) W_Q or W_K from the interleaved to the half layout.

    Head coordinates (0, 1, 2, 3, ...) become (0, 2, 4, ..., 1, 3, 5, ...): the pair (2i, 2i+1) moves to
    (i, i + d_k/2). A layer with the half layout and these weights computes what the interleaved
    layer computed with the original ones, because q . k is unchanged when both are permuted alike.
    """
    d_in, width = W.shape
    if width % num_heads:
        raise ValueError(f"W has {width} columns, not divisible by num_heads={num_heads}")
    d_k = width // num_heads
    _check_even(d_k, "the head size")
    perm = np.concatenate([np.arange(0, d_k, 2), np.arange(1, d_k, 2)])  # (d_k,)
    # (d_in, h * d_k) -> (d_in, h, d_k) -> permute within each head -> (d_in, h * d_k)
    return W.reshape(d_in, num_heads, d_k)[:, :, perm].reshape(d_in, width)


class RotaryAttention(GroupedQueryAttention):
    r"""Grouped-query attention with RoPE on the queries and keys (Llama's attention), forward only.

    .. math:: \mathrm{head}_i = \mathrm{softmax}\Big(\frac{(R_{m} q_{i,m}) \cdot (R_{n} k_{g(i),n})}
              {\sqrt{d_k}} + M\Big)_{mn} V_{g(i)}

    ``offset`` is the absolute position of the first token of X: 0 for a prompt, the number of
    cached positions for a token being decoded. Keys are rotated once, at their own position,
    before they are cached; ``prefill`` and ``decode_step`` of ``mha_lab.cpu.decode`` pass the
    offset. There is no backward: this layer serves the chapter on positions and decoding.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, layout: Layout = "half",
                 base: float = 10000.0, seed: int | None = None, dtype=np.float64) -> None:
        super().__init__(d_model, num_heads, num_kv_heads or num_heads, seed=seed, dtype=dtype)
        _check_even(self.d_k, "the head size d_model // num_heads")
        _pairs(layout, self.d_k)  # validates the name
        self.layout, self.base = layout, base

    def rotate(self, x: np.ndarray, offset: int) -> np.ndarray:
        """RoPE at positions offset, offset+1, ...: (B, heads, L, d_k) -> (B, heads, L, d_k)."""
        positions = np.arange(offset, offset + x.shape[-2])
        return apply_rope(x, positions, self.layout, self.base).astype(self.dtype, copy=False)

    def project_qkv(self, X: np.ndarray, X_kv: np.ndarray | None = None, *,
                    offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q and K rotated at positions ``offset + i``; V as is.

        Self-attention only: queries and keys are rotated at positions in one
        sequence, so keys from another sequence (``X_kv``) are refused.
        Shapes: X (B, L, d_model) -> Q (B, h, L, d_k); K, V (B, h_kv, L, d_k).
        """
        if X_kv is not None:  # cross-attention: no positions shared by queries and keys
            raise ValueError("RotaryAttention is self-attention: it takes no X_kv")
        Q, K, V = super().project_qkv(X)
        return self.rotate(Q, offset), self.rotate(K, offset), V

    def forward(self, X: np.ndarray, mask: np.ndarray | None = None, *, X_kv: np.ndarray | None = None,
                offset: int = 0) -> np.ndarray:
        """(B, L, d_model) -> (B, L, d_model) for tokens at positions ``offset .. offset+L-1``."""
        Q, K, V = self.project_qkv(X, X_kv, offset=offset)
        Z, A = scaled_dot_product_attention(Q, K, V, mask, enable_gqa=True)  # (B, h, L, d_k), (B, h, L, L)
        self.attention_weights = A
        return self.project_out(Z)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        raise NotImplementedError("RotaryAttention is forward-only (inference and decoding): it has no "
                                  "backward pass")


def alibi_slopes(num_heads: int) -> np.ndarray:
    r"""ALiBi's per-head slopes :math:`\alpha_i = 2^{-8(i+1)/h}` for heads i = 0..h-1 (m in the paper).

    For h not a power of two (Press et al., appendix): the slopes of the nearest smaller power
    of two n, then every other slope of 2n, up to h in all. Shape (h,).
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    n = 2 ** int(np.floor(np.log2(num_heads)))

    def geometric(count: int) -> np.ndarray:
        return 2.0 ** (-8.0 * np.arange(1, count + 1) / count)

    return np.concatenate([geometric(n), geometric(2 * n)[0::2][: num_heads - n]])


def alibi_bias(num_heads: int, seq_len_q: int, seq_len_k: int | None = None, offset: int = 0) -> np.ndarray:
    r"""ALiBi's additive score bias :math:`-\alpha_i\,|p_m - p_n|` of head i, query m and key n, added to the
    scores like a mask.

    Shapes: -> (1, h, L_q, L_k). Key n sits at position :math:`p_n = \text{offset} + n`, and the
    queries are the last L_q of the L_k positions (decoding), so query m sits at
    :math:`p_m = \text{offset} + L_k - L_q + m`. Under a causal mask this is the paper's
    :math:`\alpha_i\,(p_n - p_m)`; add ``create_causal_mask`` for a decoder. ``offset`` places
    the sequence as in the other encodings; only distances enter the bias.
    """
    L_k = seq_len_q if seq_len_k is None else seq_len_k
    if seq_len_q > L_k:
        raise ValueError(f"seq_len_q={seq_len_q} > seq_len_k={L_k}: queries are the last positions of the keys")
    k_pos = np.arange(offset, offset + L_k)  # (L_k,)
    q_pos = k_pos[L_k - seq_len_q:]  # (L_q,)
    distance = np.abs(q_pos[:, None] - k_pos[None, :])  # (L_q, L_k)
    return -alibi_slopes(num_heads)[None, :, None, None] * distance  # (1, h, L_q, L_k)
