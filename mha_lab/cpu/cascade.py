r"""Cascade (shared-prefix) attention, as FlashInfer does it, in NumPy.

When B requests decode after one shared prefix of L_pre positions, plain paged attention reads
the prefix's keys and values B times, once per request. Cascade attention splits each request's
keys in two levels: the **shared** prefix, attended by the queries of all B requests in one
pass (one read of the prefix, B·h query rows instead of h), and each request's **own** suffix.
Each level leaves a softmax state (s_max, ℓ, acc) per query, and the two are merged exactly as
split-K's chunks are (``merge_partials``), with :math:`s^\ast = \max(s^\text{pre}_\text{max},
s^\text{own}_\text{max})`:

.. math:: z = \frac{e^{s^\text{pre}_\text{max} - s^\ast} \text{acc}^\text{pre}
                    + e^{s^\text{own}_\text{max} - s^\ast} \text{acc}^\text{own}}
                   {e^{s^\text{pre}_\text{max} - s^\ast} \ell^\text{pre}
                    + e^{s^\text{own}_\text{max} - s^\ast} \ell^\text{own}}
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.functional import check_rank
from mha_lab.cpu.split_k import merge_partials, split_k_partials

__all__ = ["group_queries", "cascade_attention", "cascade_bytes"]


def group_queries(q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Line up the query rows that read each key/value head: (B, h, 1, d_k) -> (h_kv, B·h/h_kv, d_k)."""
    B, h, _, d_k = q.shape
    if h % num_kv_heads:
        raise ValueError(f"num_heads={h} is not a multiple of num_kv_heads={num_kv_heads}")
    # (B, h, 1, d_k) -> (B, h_kv, h/h_kv, d_k) -> (h_kv, B, h/h_kv, d_k) -> (h_kv, B·h/h_kv, d_k)
    return q.reshape(B, num_kv_heads, h // num_kv_heads, d_k).transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, d_k)


def _level_state(queries: np.ndarray, K: np.ndarray, V: np.ndarray) -> list[np.ndarray]:
    """One level's softmax state: queries (h_kv, r, d_k) -> m, l (h_kv, r, 1), acc (h_kv, r, d_k)."""
    return [x[0] for x in split_k_partials(queries, K, V, num_splits=1)]


def _ungroup(x: np.ndarray, B: int, h: int) -> np.ndarray:
    """``group_queries`` undone for a state: (h_kv, B·h/h_kv, ·) -> (B, h, 1, ·)."""
    h_kv = x.shape[0]
    # (h_kv, B·h/h_kv, ·) -> (h_kv, B, h/h_kv, ·) -> (B, h_kv, h/h_kv, ·) -> (B, h, 1, ·)
    return x.reshape(h_kv, B, h // h_kv, -1).transpose(1, 0, 2, 3).reshape(B, h, 1, -1)


def cascade_attention(q: np.ndarray, K_shared: np.ndarray, V_shared: np.ndarray,
                      K_own: list[np.ndarray], V_own: list[np.ndarray]) -> np.ndarray:
    """Decoding queries over a shared prefix, read once, and their own suffixes.

    Shapes: q (B, h, 1, d_k); K_shared, V_shared (h_kv, L_pre, d_k); K_own[i],
    V_own[i] (h_kv, L_own_i, d_k), L_own_i >= 1 -> (B, h, 1, d_k): request i's
    attention over the prefix followed by its suffix.
    """
    check_rank("q", q, 4, "(B, h, 1, d_k)")
    B, h, one, _ = q.shape
    if one != 1 or len(K_own) != B or len(V_own) != B:
        raise ValueError(f"q must be (B, h, 1, d_k) with one suffix per request; got "
                         f"q {q.shape} and {len(K_own)}, {len(V_own)} suffixes")
    h_kv = K_shared.shape[0]
    # level 1: all B requests' queries against the prefix, in one pass
    shared = _level_state(group_queries(q, h_kv), K_shared, V_shared)
    shared = [_ungroup(x, B, h) for x in shared]  # m, l, acc: (B, h, 1, ·)
    # level 2: each request's queries against its own suffix
    own = [_level_state(group_queries(q[i:i + 1], h_kv), K, V)
           for i, (K, V) in enumerate(zip(K_own, V_own, strict=True))]
    own = [np.concatenate([_ungroup(o[j], 1, h) for o in own]) for j in range(3)]
    # the two levels stacked: m, l, acc (2, B, h, 1, ·), merged
    m, l, acc = (np.stack(pair) for pair in zip(shared, own, strict=True))
    return merge_partials(m, l, acc)[0]


def cascade_bytes(num_requests: int, prefix_len: int, suffix_len: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, itemsize: int = 2, state_itemsize: int = 4) -> dict[str, int]:
    r"""Bytes one decoding step reads, plain paged attention against cascade attention.

    ============ =========================================================================
    plain        :math:`B (L_{pre} + L_{own}) \cdot 2 h_{kv} d_k s`: every request reads the prefix
    cascade      :math:`(L_{pre} + B L_{own}) \cdot 2 h_{kv} d_k s + 2 \cdot 2 B h (d_k + 1) s_f`
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
