r"""Cascade (shared-prefix) attention, as FlashInfer does it, in NumPy.

When N requests decode after one shared prefix of P positions, plain paged attention reads the
prefix's keys and values N times, once per request. Cascade attention splits each request's
keys in two levels: the **shared** prefix, attended by the queries of all N requests in one
pass (one read of the prefix, N·h query rows instead of h), and each request's **own** suffix.
Each level leaves a softmax state (m, ℓ, acc) per query, and the two are merged exactly as
split-K's chunks are (``merge_partials``):

.. math:: o_i = \frac{e^{m^{s}_i - M} a^{s}_i + e^{m^{u}_i - M} a^{u}_i}
                     {e^{m^{s}_i - M} \ell^{s}_i + e^{m^{u}_i - M} \ell^{u}_i},
          \qquad M = \max(m^{s}_i, m^{u}_i).
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.functional import check_rank
from mha_lab.cpu.split_k import merge_partials, split_k_partials

__all__ = ["group_queries", "cascade_attention", "cascade_bytes"]


def group_queries(q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Line up every query row that reads one key/value head: (N, h, 1, d) -> (h_kv, N·h/h_kv, d)."""
    N, h, _, d = q.shape
    if h % num_kv_heads:
        raise ValueError(f"num_heads={h} is not a multiple of num_kv_heads={num_kv_heads}")
    # (N, h, 1, d) -> (N, h_kv, g, d) -> (h_kv, N, g, d) -> (h_kv, N·g, d)
    return q.reshape(N, num_kv_heads, h // num_kv_heads, d).transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, d)


def _level_state(queries: np.ndarray, K: np.ndarray, V: np.ndarray) -> list[np.ndarray]:
    """One level's softmax state: queries (h_kv, r, d) -> m, l (h_kv, r, 1), acc (h_kv, r, d)."""
    return [x[0] for x in split_k_partials(queries, K, V, num_splits=1)]


def _ungroup(x: np.ndarray, N: int, h: int) -> np.ndarray:
    """``group_queries`` undone for a state: (h_kv, N·g, ·) -> (N, h, 1, ·)."""
    h_kv = x.shape[0]
    # (h_kv, N·g, ·) -> (h_kv, N, g, ·) -> (N, h_kv, g, ·) -> (N, h, 1, ·)
    return x.reshape(h_kv, N, h // h_kv, -1).transpose(1, 0, 2, 3).reshape(N, h, 1, -1)


def cascade_attention(q: np.ndarray, K_shared: np.ndarray, V_shared: np.ndarray,
                      K_own: list[np.ndarray], V_own: list[np.ndarray]) -> np.ndarray:
    """Decoding queries over a shared prefix, read once, and their own suffixes.

    Shapes: q (N, h, 1, d); K_shared, V_shared (h_kv, P, d); K_own[i], V_own[i]
    (h_kv, S_i, d) with S_i >= 1 -> (N, h, 1, d): request i's attention over the
    prefix followed by its suffix.
    """
    check_rank("q", q, 4, "(N, h, 1, d)")
    N, h, one, d = q.shape
    if one != 1 or len(K_own) != N or len(V_own) != N:
        raise ValueError(f"q must be (N, h, 1, d) with one suffix per request; got "
                         f"q {q.shape} and {len(K_own)}, {len(V_own)} suffixes")
    h_kv = K_shared.shape[0]
    # level 1: all N requests' queries against the prefix, in one pass
    shared = _level_state(group_queries(q, h_kv), K_shared, V_shared)
    shared = [_ungroup(x, N, h) for x in shared]  # m, l, acc: (N, h, 1, ·)
    # level 2: each request's queries against its own suffix
    own = [_level_state(group_queries(q[i:i + 1], h_kv), K, V)
           for i, (K, V) in enumerate(zip(K_own, V_own, strict=True))]
    own = [np.concatenate([_ungroup(o[j], 1, h) for o in own]) for j in range(3)]
    # the two levels stacked: m, l, acc (2, N, h, 1, ·), merged
    m, l, acc = (np.stack(pair) for pair in zip(shared, own, strict=True))
    return merge_partials(m, l, acc)[0]


def cascade_bytes(num_requests: int, prefix_len: int, suffix_len: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, itemsize: int = 2, state_itemsize: int = 4) -> dict[str, int]:
    r"""Bytes one decoding step reads, plain paged attention against cascade attention.

    ============ =========================================================================
    plain        :math:`N (P + S) \cdot 2 h_{kv} d\, s`: every request reads the prefix
    cascade      :math:`(P + N S) \cdot 2 h_{kv} d\, s + 2 \cdot 2 N h (d + 1)\, s_f`
    ============ =========================================================================

    The second cascade term is the two levels' states (the partial output and its log-sum-exp,
    in float32: :math:`s_f` = 4 bytes) written by each level and read back by the merge.
    """
    if min(num_requests, prefix_len, suffix_len, num_heads, num_kv_heads, head_dim) < 1:
        raise ValueError("every size must be at least 1")
    kv_row = 2 * num_kv_heads * head_dim * itemsize  # one position's key and value
    states = 2 * 2 * num_requests * num_heads * (head_dim + 1) * state_itemsize
    return {"plain": num_requests * (prefix_len + suffix_len) * kv_row,
            "cascade": (prefix_len + num_requests * suffix_len) * kv_row + states}
