"""Memory-efficient attention: forwards and backwards that never hold every head's L x L matrix.

``head_by_head_forward`` keeps one head's (B, L, L) weights alive at a time: h times less
than the fused layer. ``chunked_attention`` goes further and never forms an L x L matrix:
it streams key/value blocks past each query block and keeps a running softmax (the
algorithm of Rabe & Staats 2021 and FlashAttention, Dao et al. 2022).
``chunked_attention_backward`` recomputes the weights tile by tile from the saved
log-sum-exp. For training a layer, ``ChunkedLayer`` uses both; ``Checkpointed`` keeps only
the input and reruns the fused forward during the backward (gradient checkpointing).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import check_mask, check_rank, merge_heads, split_heads
from mha_lab.cpu.per_head import head_forward

__all__ = ["head_by_head_forward", "chunked_forward", "online_softmax_step", "default_score_bound",
           "chunked_attention", "chunked_attention_backward", "ChunkedLayer",
           "Checkpointed"]


def head_by_head_forward(X: np.ndarray, layer: GroupedQueryAttention,
                         mask: np.ndarray | None = None) -> np.ndarray:
    r"""The layer's forward computed one head at a time; equals ``layer.forward``.

    .. math:: \mathrm{out} = b_O + \sum_i \mathrm{head}_i\, W_O^{(i)}

    Peak memory: one (B, L, L) attention matrix instead of (B, h, L, L).
    Shapes: X: (B, L, d_model) -> (B, L, d_model).
    """
    X = layer.check_input(X)
    # (B, L, d_model)
    out = np.zeros(X.shape[:2] + (layer.W_O.shape[1],), dtype=X.dtype)
    for i in range(layer.num_heads):
        # head i's (B, L, L) weights die with this statement
        out += head_forward(X, layer, i, mask)[0]
    if layer.use_bias:
        out += layer.b_O
    return out


def chunked_forward(X: np.ndarray, layer: GroupedQueryAttention, **options: float) -> np.ndarray:
    """The layer's forward with ``chunked_attention`` as its core: no (L, L) matrix is formed.

    ``options`` (``block_q``, ``block_k``, ``score_bound``) go to ``chunked_attention``; its defaults otherwise.
    Shapes: X: (B, L, d_model) -> (B, L, d_model).
    """
    Q, K, V = layer.project_qkv(X)  # (B, h, L, d_k), (B, h_kv, L, d_k), (B, h_kv, L, d_k)
    Z = chunked_attention(Q, K, V, **options)  # (B, h, L, d_k)
    del Q, K, V  # free the projections before the output projection allocates
    return layer.project_out(Z)  # (B, h, L, d_k) -> (B, L, d_model)


def _check_qkv(Q: np.ndarray, K: np.ndarray, V: np.ndarray, causal: bool, block_q: int, block_k: int) -> None:
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        check_rank(name, t, 4, "(B, heads, L, d)")
    B, h, Lq, d = Q.shape
    if K.shape[-1] != d or K.shape[:3] != V.shape[:3] or K.shape[0] != B:
        raise ValueError(f"incompatible shapes Q {Q.shape}, K {K.shape}, V {V.shape}")
    if h % K.shape[1]:
        raise ValueError(f"query heads ({h}) are not divisible by key/value heads ({K.shape[1]})")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if causal and Lq != K.shape[2]:
        raise ValueError(f"causal attention needs L_q == L_k, got {Lq} and {K.shape[2]}")


def _grouped_mask(mask: np.ndarray | None, B: int, h: int, h_kv: int, Lq: int, Lk: int) -> np.ndarray | None:
    """Check an additive mask and view it as (B, h_kv, n_rep, Lq, Lk), the grouped layout; never a copy."""
    if mask is None:
        return None
    check_mask(mask, (B, h, Lq, Lk))
    # (B, h, Lq, Lk) broadcast view -> (B, h_kv, n_rep, Lq, Lk): splitting an axis never copies
    return np.broadcast_to(mask, (B, h, Lq, Lk)).reshape(B, h_kv, h // h_kv, Lq, Lk)


def _block_scores(q: np.ndarray, k: np.ndarray, qs: int, ks: int, causal: bool,
                  mask: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """Scores of one (query block, key block) tile: q (already scaled) k^T, causal- and mask-adjusted; written
    into ``out`` when given (a buffer reused from tile to tile, allocated and paged in once).

    Shapes: q (..., bq, d), k (..., bk, d) -> (..., bq, bk), e.g. (n_rep, bq, d), (1, bk, d) for one K/V head;
    ``mask`` indexed [..., query, key] in the same layout.
    """
    s = np.matmul(q, np.swapaxes(k, -1, -2), out=out)
    qe, ke = qs + q.shape[-2], ks + k.shape[-2]
    if causal and ke - 1 > qs:  # the block crosses the diagonal
        s[..., np.arange(qs, qe)[:, None] < np.arange(ks, ke)] = -np.inf
    if mask is not None:
        s += mask[..., qs:qe, ks:ke]
    return s


def online_softmax_step(m_i: np.ndarray, l_i: np.ndarray, acc: np.ndarray,
                        s: np.ndarray, v: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""One key block's update of a query tile's running state; overwrites ``s``.

    .. math:: m' = \max(m, \max_j s_j), \quad
              \ell' = e^{m - m'} \ell + \sum_j e^{s_j - m'}, \quad
              \mathrm{acc}' = e^{m - m'} \mathrm{acc} + e^{s - m'} v

    Shapes: m_i, l_i (..., bq, 1); acc (..., bq, d_v); s (..., bq, bk);
    v (..., bk, d_v). Returns the new (m_i, l_i, acc); ``acc`` is updated in
    place. A row whose scores are all -inf so far keeps m = -inf, l = acc = 0.
    """
    m_new = np.maximum(m_i, s.max(axis=-1, keepdims=True))
    # rows masked so far stay at zero
    shift = np.where(np.isneginf(m_new), 0.0, m_new)
    s -= shift
    np.exp(s, out=s)  # s now holds p = exp(S - m'), in place
    # rescales what was accumulated under the old max
    alpha = np.exp(m_i - shift)
    l_new = alpha * l_i + s.sum(axis=-1, keepdims=True)
    acc *= alpha
    acc += s @ v
    return m_new, l_new, acc


def default_score_bound(dtype: npt.DTypeLike) -> float:
    r"""A tenth of ``dtype``'s exponent range, :math:`\ln(\text{largest})/10`: 71 in float64, 8.9 in float32.

    Scores within it keep :math:`e^{S}` so far inside the range that the sums have the other nine tenths.
    """
    return float(np.log(np.finfo(dtype).max)) / 10


def chunked_attention(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, causal: bool = False,
    mask: np.ndarray | None = None, block_q: int = 512, block_k: int = 512,
    return_lse: bool = False, score_bound: float | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    r"""Exact attention in query/key blocks with an online softmax; no L x L matrix.

    For each query block, with running row maximum :math:`m`, normaliser :math:`\ell`
    and unnormalised output :math:`a`, every key block
    :math:`S = q k^\top / \sqrt{d_k}` updates

    .. math:: m' = \max(m, \max_j S_j), \quad
              \ell' = e^{m - m'} \ell + \sum_j e^{S_j - m'}, \quad
              a' = e^{m - m'} a + e^{S - m'} v

    and the block's output is :math:`a / \ell`. Causal attention skips the key blocks
    that lie wholly above the diagonal. With ``return_lse`` it also returns each row's
    log-sum-exp :math:`m + \log \ell = \log \sum_j e^{S_j}`, all that
    ``chunked_attention_backward`` needs to recompute the weights. The default
    tiles, 512 queries by 512 keys, were the fastest measured on a 2-core AMD
    EPYC (``python -m mha_lab bench --sections tiles``).

    The maximum only keeps :math:`e^{S}` in range. Where Cauchy-Schwarz,
    :math:`|S_{ij}| \le |q_i| \max_j |k_j|`, puts a query block's scores within
    :math:`\pm` ``score_bound``, the block keeps :math:`m = 0` and skips the max, the
    subtraction and the rescaling. The default is ``default_score_bound``, 71 in
    float64 (:math:`e^{\pm 71}` against :math:`e^{\pm 709}`); a bound given may be up
    to half the range. ``score_bound=0``, or a ``mask``, keeps the running max.

    Shapes:
        Q: (B, h, L_q, d); K, V: (B, h_kv, L_k, d), h % h_kv == 0 (GQA/MQA share K/V)
        mask: optional additive mask broadcastable to (B, h, L_q, L_k), read by blocks
        returns: (B, h, L_q, d_v), and the log-sum-exp (B, h, L_q) with ``return_lse``
    """
    _check_qkv(Q, K, V, causal, block_q, block_k)
    B, h, Lq, d = Q.shape
    h_kv, Lk = K.shape[1], K.shape[2]
    n_rep = h // h_kv
    mask = _grouped_mask(mask, B, h, h_kv, Lq, Lk)
    dtype = np.result_type(Q, K, V)
    half_range = 5 * default_score_bound(dtype)  # past it, the sums have no room
    if score_bound is None:
        score_bound = default_score_bound(dtype)
    elif not 0 <= score_bound <= half_range:
        raise ValueError(f"score_bound must lie in [0, {half_range:.1f}] "
                         f"for {dtype}, got {score_bound}")
    scale = 1.0 / np.sqrt(d)
    # (B, h, Lq, d) -> (B, h_kv, n_rep, Lq, d): groups share K/V
    Qg = Q.reshape(B, h_kv, n_rep, Lq, d)
    Kg, Vg = K[:, :, None], V[:, :, None]  # (B, h_kv, L, d) -> (B, h_kv, 1, L, d)
    out = np.empty((B, h_kv, n_rep, Lq, V.shape[-1]), dtype=dtype)
    lse = np.empty((B, h_kv, n_rep, Lq, 1), dtype=dtype)
    # one buffer for every tile's scores (a new array per tile: 4% slower at L = 4096)
    scores = np.empty((n_rep, min(block_q, Lq), min(block_k, Lk)), dtype=dtype)
    # max_j |k_j| of each K/V head: (B, h_kv, Lk, d) -> (B, h_kv)
    k_norm = np.sqrt(np.einsum("bgld,bgld->bgl", K, K).max(axis=-1, initial=0.0))
    # one sequence and K/V head at a time: a tile of scores stays in cache
    for b, g in np.ndindex(B, h_kv):
        for qs in range(0, Lq, block_q):
            qe = min(qs + block_q, Lq)
            q = Qg[b, g, :, qs:qe] * scale  # (n_rep, bq, d)
            q_norm = np.sqrt(np.einsum("...d,...d->...", q, q).max())  # max_i |q_i|
            # |S| <= score_bound: e^S can neither overflow nor underflow
            bounded = mask is None and q_norm * k_norm[b, g] <= score_bound
            # running row max (0 if bounded), softmax denominator, numerator @ V
            m_start = 0.0 if bounded else -np.inf
            m_i = np.full(q.shape[:-1] + (1,), m_start, dtype=dtype)
            l_i = np.zeros_like(m_i)
            acc = np.zeros(q.shape[:-1] + (V.shape[-1],), dtype=dtype)
            # keys past the last query of the block are all in the future
            k_stop = qe if causal else Lk
            for ks in range(0, k_stop, block_k):
                ke = min(ks + block_k, k_stop)
                tile = scores[:, :qe - qs, :ke - ks]  # (n_rep, bq, bk)
                s = _block_scores(q, Kg[b, g, :, ks:ke], qs, ks, causal,
                                  None if mask is None else mask[b, g], out=tile)
                if bounded:  # steps 1 and 2 vanish: nothing to subtract or rescale
                    np.exp(s, out=s)
                    l_i += s.sum(axis=-1, keepdims=True)
                    acc += s @ Vg[b, g, :, ks:ke]
                else:
                    m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s,
                                                        Vg[b, g, :, ks:ke])
            if not np.all(l_i > 0):
                raise ValueError("chunked_attention: a query row is fully masked; "
                                 "no key can be attended to")
            out[b, g, :, qs:qe] = acc / l_i
            lse[b, g, :, qs:qe] = m_i + np.log(l_i)
    # (B, h_kv, n_rep, Lq, d_v) -> (B, h, Lq, d_v)
    out = out.reshape(B, h, Lq, V.shape[-1])
    # (B, h_kv, n_rep, Lq, 1) -> (B, h, Lq)
    return (out, lse.reshape(B, h, Lq)) if return_lse else out


def chunked_attention_backward(grad_O: np.ndarray, Q: np.ndarray, K: np.ndarray, V: np.ndarray,
                               O: np.ndarray, lse: np.ndarray, causal: bool = False,
                               mask: np.ndarray | None = None, block_q: int = 128,
                               block_k: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Gradients of Q, K, V from the forward's output O and log-sum-exp, one tile at a time.

    Each tile of weights is recomputed, :math:`A = e^{S - \mathrm{lse}}`, and steps 3 to 5 of
    the fused backward run on it; the row sums that step 4 needs come from O instead of A:

    .. math:: D = \operatorname{rowsum}(\nabla_O \odot O) = \operatorname{rowsum}(\nabla_A \odot A),
              \quad \nabla_S = A \odot (\nabla_O V^\top - D), \quad
              \nabla_Q = \nabla_S K / \sqrt{d}, \quad \nabla_K = \nabla_S^\top Q / \sqrt{d},
              \quad \nabla_V = A^\top \nabla_O

    Shapes: as ``chunked_attention``: grad_O, O (B, h, L_q, d_v); lse (B, h, L_q);
    returns grad_Q (B, h, L_q, d), grad_K and grad_V (B, h_kv, L_k, d), summed over each group.
    """
    _check_qkv(Q, K, V, causal, block_q, block_k)
    B, h, Lq, d = Q.shape
    h_kv, Lk, d_v = K.shape[1], K.shape[2], V.shape[-1]
    n_rep = h // h_kv
    if grad_O.shape != (B, h, Lq, d_v) or O.shape != grad_O.shape or lse.shape != (B, h, Lq):
        raise ValueError(f"grad_O {grad_O.shape}, O {O.shape} must be {(B, h, Lq, d_v)} and lse {lse.shape} "
                         f"must be {(B, h, Lq)}")
    mask = _grouped_mask(mask, B, h, h_kv, Lq, Lk)
    scale = 1.0 / np.sqrt(d)
    # (B, h, Lq, .) -> (B, h_kv, n_rep, Lq, .): query heads grouped under their shared K/V head
    Qg, dOg = Q.reshape(B, h_kv, n_rep, Lq, d), grad_O.reshape(B, h_kv, n_rep, Lq, d_v)
    lse_g = lse.reshape(B, h_kv, n_rep, Lq, 1)  # (B, h, Lq) -> (B, h_kv, n_rep, Lq, 1)
    D = np.einsum("...j,...j->...", grad_O, O).reshape(B, h_kv, n_rep, Lq, 1)  # rowsum(dO * O)
    Kg, Vg = K[:, :, None], V[:, :, None]  # (B, h_kv, L, d) -> (B, h_kv, 1, L, d)
    grad_Q = np.empty_like(Qg, dtype=np.result_type(Q, grad_O))
    grad_K = np.zeros(K.shape, dtype=grad_Q.dtype)  # (B, h_kv, Lk, d)
    grad_V = np.zeros(V.shape, dtype=grad_Q.dtype)
    for qs in range(0, Lq, block_q):
        qe = min(qs + block_q, Lq)
        q = Qg[..., qs:qe, :] * scale  # (B, h_kv, n_rep, bq, d)
        do = dOg[..., qs:qe, :]  # (B, h_kv, n_rep, bq, d_v)
        dq = np.zeros_like(q)
        for ks in range(0, qe if causal else Lk, block_k):
            ke = min(ks + block_k, qe if causal else Lk)
            a = _block_scores(q, Kg[..., ks:ke, :], qs, ks, causal, mask)  # (B, h_kv, n_rep, bq, bk)
            a -= lse_g[..., qs:qe, :]
            np.exp(a, out=a)  # the tile of A, recomputed in place
            grad_V[..., ks:ke, :] += (np.swapaxes(a, -1, -2) @ do).sum(axis=2)  # step 3, summed over the group
            ds = do @ np.swapaxes(Vg[..., ks:ke, :], -1, -2)  # step 3: the tile of grad_A
            ds -= D[..., qs:qe, :]
            ds *= a  # step 4: grad_S = A * (grad_A - D), in place
            dq += ds @ Kg[..., ks:ke, :]  # step 5 (scaled once below)
            grad_K[..., ks:ke, :] += (np.swapaxes(ds, -1, -2) @ q).sum(axis=2)  # q carries the scale
        grad_Q[..., qs:qe, :] = dq * scale
    return grad_Q.reshape(B, h, Lq, d), grad_K, grad_V  # (B, h_kv, n_rep, Lq, d) -> (B, h, Lq, d)


class ChunkedLayer:
    """A layer trained with the chunked core: keeps X, Q, K, V, O and one number per row.

    Steps 1, 2, 6 and 7 of the backward are the fused layer's; steps 3 to 5 run tile by tile
    in ``chunked_attention_backward``. Gradients land on the wrapped layer (``grad_W_Q`` ...).
    Shapes: X (B, L, d_model) -> (B, L, d_model).
    """

    def __init__(self, layer: GroupedQueryAttention, causal: bool = False, block_q: int = 128,
                 block_k: int = 256) -> None:
        self.layer, self.causal, self.blocks = layer, causal, {"block_q": block_q, "block_k": block_k}
        self._saved: dict | None = None

    def forward(self, X: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """The layer's forward with ``chunked_attention`` as its core; ``mask`` is additive."""
        layer = self.layer
        X = layer.check_input(X)
        Q, K, V = layer.project_qkv(X)  # (B, h, L, d_k), (B, h_kv, L, d_k), (B, h_kv, L, d_k)
        O, lse = chunked_attention(Q, K, V, self.causal, mask, return_lse=True, **self.blocks)
        self._saved = {"X": X, "Q": Q, "K": K, "V": V, "O": O, "lse": lse, "mask": mask}
        return layer.project_out(O)  # (B, h, L, d_k) -> (B, L, d_model)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        """Store the wrapped layer's grad_W_* (and grad_b_*) and return dL/dX."""
        if self._saved is None:
            raise RuntimeError("backward() called before forward(): nothing is saved")
        c, layer = self._saved, self.layer
        grad_concat = layer.project_backward(merge_heads(c["O"]), grad_out, "O")  # step 1
        grad_O = split_heads(grad_concat, layer.num_heads)  # step 2: (B, L, d_model) -> (B, h, L, d_k)
        grad_Q, grad_K, grad_V = chunked_attention_backward(  # steps 3-5, tile by tile
            grad_O, c["Q"], c["K"], c["V"], c["O"], c["lse"], self.causal, c["mask"], **self.blocks)
        # step 6: (B, h, L, d_k) -> (B, L, h*d_k); step 7: the projections, summed into grad_X
        grads = {"Q": merge_heads(grad_Q), "K": merge_heads(grad_K), "V": merge_heads(grad_V)}
        self._saved = None
        return sum(layer.project_backward(c["X"], grads[n], n) for n in "QKV")


class Checkpointed:
    """Gradient checkpointing: keep only X between forward and backward, rerun the forward in backward.

    Costs one extra forward per step; saves the layer's whole cache, (B, h, L, L) weights included,
    for the time between the forward and the backward. Gradients land on the wrapped layer.
    """

    def __init__(self, layer: GroupedQueryAttention) -> None:
        self.layer = layer
        self._saved: tuple | None = None

    def forward(self, X: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """The fused forward, after which everything but the input is dropped."""
        out = self.layer.forward(X, mask)
        self.layer.clear_cache()
        self._saved = (X, mask)
        return out

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        """Recompute the forward from the saved X, then run the fused backward and drop its cache."""
        if self._saved is None:
            raise RuntimeError("backward() called before forward(): nothing is saved")
        self.layer.forward(*self._saved)
        grad_X = self.layer.backward(grad_out)
        self.layer.clear_cache()
        self._saved = None
        return grad_X
