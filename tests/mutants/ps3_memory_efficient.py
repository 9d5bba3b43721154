"""Known bugs in ps3_memory_efficient, each in one answer cell, and the tests cells they must fail;
and correct solutions written differently, which must keep every point."""

from tests.mutants import NOT_AVAILABLE, Mutant, Variant

HBH = "head_by_head_forward"
CHUNKED = "chunked_attention"
# Memory is graded in its own cell, for the computation asked for: a bug that shows at the measured size
# (no causal mask, moderate scores, whole blocks) costs the memory cell too; one that does not, never.
CHUNKED_VALUES = {"chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability"}

MUTANTS = [
    Mutant("peak_reads_current_size", "measure_peak",
           "_, peak = tracemalloc.get_traced_memory()", "peak, _ = tracemalloc.get_traced_memory()",
           {"measure_peak_values"}, "take the PEAK"),
    Mutant("every_head_kept_alive", HBH,
           "        out += (S @ V) @ W_O[cols, :]",
           "        kept = locals().get(\"kept\", []) + [S]  # every head's weights, for plotting later\n"
           "        out += (S @ V) @ W_O[cols, :]",
           {"head_by_head_forward_memory"}, "more than one head's (B, L, L) scores are alive at once"),
    Mutant("full_score_tensor_built", HBH,
           "    for i in range(num_heads):",
           "    Q_all = (X @ W_Q).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)  # (B, h, L, d_k)\n"
           "    K_all = (X @ W_K).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)  # (B, h, L, d_k)\n"
           "    S_all = Q_all @ K_all.transpose(0, 1, 3, 2)  # (B, h, L, L): every head's scores at once\n"
           "    for i in range(num_heads):",
           {"head_by_head_forward_memory"}, "a full (B, h, L, L) score tensor"),
    Mutant("scale_by_sqrt_d_model", HBH,
           "scale = 1.0 / np.sqrt(d_k)", "scale = 1.0 / np.sqrt(d_model)",
           {"head_by_head_forward_values", "head_by_head_forward_mask", "head_by_head_forward_memory"},
           "scaled by sqrt(d_model)"),
    Mutant("head_softmax_without_row_max", HBH,
           "        S -= S.max(axis=-1, keepdims=True)  # softmax in place: one (B, L, L) buffer for this head\n", "",
           {"head_by_head_forward_stability"}, "subtract each row's maximum"),
    Mutant("no_rescale_of_accumulator", CHUNKED,
           "acc = alpha * acc + P @ V[:, :, ks:ke]", "acc = acc + P @ V[:, :, ks:ke]",
           CHUNKED_VALUES | {"chunked_attention_memory"}, "rescale the accumulator"),
    Mutant("running_max_not_updated", CHUNKED,
           "            m_i = m_new\n", "",
           CHUNKED_VALUES | {"chunked_attention_memory"}, "carry the running max m forward"),
    Mutant("running_max_starts_at_zero", CHUNKED,
           "m_i = np.full((B, h, qe - qs, 1), -np.inf)", "m_i = np.zeros((B, h, qe - qs, 1))",
           {"chunked_attention_stability"}, "start m at -inf"),
    Mutant("diagonal_masked_too", CHUNKED,
           "np.arange(qs, qe)[:, None] < np.arange(ks, ke)[None, :]",
           "np.arange(qs, qe)[:, None] <= np.arange(ks, ke)[None, :]",
           {"chunked_attention_causal"}, "also hides the diagonal"),
    Mutant("exp_without_max", CHUNKED,
           "m_new = np.maximum(m_i, S.max(axis=-1, keepdims=True))", "m_new = np.zeros_like(m_i)",
           {"chunked_attention_stability"}, "subtract the running maximum"),
    Mutant("last_partial_block_dropped", CHUNKED,
           "n_blocks = -(-L // block_size)", "n_blocks = L // block_size",
           {"chunked_attention_values", "chunked_attention_causal"}, "partial block is skipped"),
    Mutant("row_maxima_from_every_score", CHUNKED,
           "    for qb in range(n_blocks):\n",
           "    m_all = (Q @ K.transpose(0, 1, 3, 2)).max(axis=-1, keepdims=True)  # (B, h, L, L) -> (B, h, L, 1)\n"
           "    for qb in range(n_blocks):\n",
           {"chunked_attention_memory"}, "an L x L (or L x block_size) score matrix is built"),
    Mutant("answer_from_mha_lab", CHUNKED,
           "    B, h, L, d = Q.shape\n",
           "    from mha_lab.cpu import chunked_attention as fast\n"
           "    return fast(Q, K, V, causal=causal, block_q=block_size, block_k=block_size)\n"
           "    B, h, L, d = Q.shape\n",
           {"chunked_attention_shape", "chunked_attention_memory"} | CHUNKED_VALUES,
           NOT_AVAILABLE),
]

# --- correct solutions written differently ------------------------------------------------------

PEAK_NO_FINALLY = '''def measure_peak(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once under tracemalloc; return ``(result, peak_bytes)``."""
    tracemalloc.start()
    result = fn(*args, **kwargs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, peak
'''

PEAK_RESET = '''def measure_peak(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once under tracemalloc; return ``(result, peak_bytes)``."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.clear_traces()
    tracemalloc.reset_peak()
    try:
        result = fn(*args, **kwargs)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return result, int(peak)
'''

HBH_EINSUM_NEW_ARRAYS = '''def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """One head at a time, with einsum and a softmax that makes new arrays."""
    d_k = X.shape[-1] // num_heads
    out = 0.0
    for i in range(num_heads):
        c = slice(i * d_k, (i + 1) * d_k)
        Q = np.einsum("bld,dk->blk", X, W_Q[:, c])
        K = np.einsum("bld,dk->blk", X, W_K[:, c])
        V = np.einsum("bld,dk->blk", X, W_V[:, c])
        S = np.einsum("bik,bjk->bij", Q, K) / np.sqrt(d_k)  # (B, L, L)
        if mask is not None:
            S = S + mask
        E = np.exp(S - S.max(axis=-1, keepdims=True))
        A = E / E.sum(axis=-1, keepdims=True)
        out = out + np.einsum("bij,bjk,km->bim", A, V, W_O[c, :])
    return out
'''

HBH_CONCAT_HEADS = '''def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Keep each head's (B, L, d_k) output (not its weights), concatenate, project once."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    heads = []
    for i in reversed(range(num_heads)):  # any order: the heads are independent
        Q = X @ W_Q[:, i * d_k:(i + 1) * d_k] / np.sqrt(d_k)  # scale Q, not S
        K = X @ W_K[:, i * d_k:(i + 1) * d_k]
        V = X @ W_V[:, i * d_k:(i + 1) * d_k]
        S = Q @ np.swapaxes(K, 1, 2)
        if mask is not None:
            S += mask
        np.subtract(S, np.max(S, axis=2, keepdims=True), out=S)
        np.exp(S, out=S)
        np.divide(S, np.sum(S, axis=2, keepdims=True), out=S)
        heads.insert(0, S @ V)  # (B, L, d_k)
        del S
    return np.concatenate(heads, axis=-1) @ W_O  # (B, L, h * d_k) @ (d_model, d_model)
'''

HBH_PER_SEQUENCE = '''def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Loop over sequences, then heads, with 2-D matrices only."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    out = np.zeros((B, L, d_model))
    for b in range(B):
        for i in range(num_heads):
            rows = np.arange(i * d_k, (i + 1) * d_k)
            q, k, v = X[b] @ W_Q[:, rows], X[b] @ W_K[:, rows], X[b] @ W_V[:, rows]  # (L, d_k)
            s = (q @ k.T) * (1.0 / np.sqrt(d_k))
            if mask is not None:
                s = s + mask
            p = np.exp(s - np.max(s, axis=1)[:, None])
            out[b] += (p / p.sum(axis=1)[:, None]) @ v @ W_O[rows]
    return out
'''

CHUNKED_PRESCALED_Q = '''def chunked_attention(Q, K, V, block_size, causal=False):
    """Q scaled once up front (one extra copy of Q, O(L d)); new arrays everywhere."""
    B, h, L, d = Q.shape
    Qs = Q / np.sqrt(d)  # (B, h, L, d): one extra copy of Q
    out = np.zeros_like(V)
    for qs in range(0, L, block_size):
        qe = min(qs + block_size, L)
        m = np.full((B, h, qe - qs, 1), -np.inf)
        l = np.zeros((B, h, qe - qs, 1))
        acc = np.zeros((B, h, qe - qs, d))
        for ks in range(0, qe if causal else L, block_size):
            ke = min(ks + block_size, L)
            S = Qs[:, :, qs:qe] @ np.swapaxes(K[:, :, ks:ke], -1, -2)  # (B, h, bq, bk)
            if causal:
                S = np.where(np.arange(ks, ke)[None, :] > np.arange(qs, qe)[:, None], -np.inf, S)
            m_new = np.maximum(m, np.max(S, axis=-1, keepdims=True))
            P = np.exp(S - m_new)
            l = l * np.exp(m - m_new) + np.sum(P, axis=-1, keepdims=True)
            acc = acc * np.exp(m - m_new) + P @ V[:, :, ks:ke]
            m = m_new
        out[:, :, qs:qe] = acc / l
    return out
'''

CHUNKED_KEYS_OUTER = '''def chunked_attention(Q, K, V, block_size, causal=False):
    """Key blocks in the outer loop; the running state of every query row (O(L d)) lives across it."""
    B, h, L, d = Q.shape
    m = np.full((B, h, L, 1), -np.inf)
    l = np.zeros((B, h, L, 1))
    acc = np.zeros((B, h, L, V.shape[-1]))
    for ks in range(0, L, block_size):
        ke = min(ks + block_size, L)
        k, v = K[:, :, ks:ke], V[:, :, ks:ke]
        for qs in range(ks - ks % block_size if causal else 0, L, block_size):  # causal: only rows i >= ks
            qe = min(qs + block_size, L)
            S = np.einsum("bhid,bhjd->bhij", Q[:, :, qs:qe], k) / np.sqrt(d)
            if causal:
                S[..., np.arange(ks, ke)[None, :] > np.arange(qs, qe)[:, None]] = -np.inf
            m_old = m[:, :, qs:qe]
            m_new = np.maximum(m_old, S.max(axis=-1, keepdims=True))
            P = np.exp(S - m_new)
            alpha = np.exp(m_old - m_new)
            l[:, :, qs:qe] = alpha * l[:, :, qs:qe] + P.sum(axis=-1, keepdims=True)
            acc[:, :, qs:qe] = alpha * acc[:, :, qs:qe] + np.einsum("bhij,bhjd->bhid", P, v)
            m[:, :, qs:qe] = m_new
    acc /= l
    return acc
'''

CHUNKED_PER_HEAD_2D = '''def chunked_attention(Q, K, V, block_size, causal=False):
    """One (sequence, head) pair at a time with 2-D tiles; the state is updated in place."""
    B, h, L, d = Q.shape
    out = np.empty(Q.shape[:-1] + V.shape[-1:])
    n = (L + block_size - 1) // block_size
    for b in range(B):
        for j in range(h):
            for qb in range(n):
                q = Q[b, j, qb * block_size:(qb + 1) * block_size]  # (bq, d); slicing stops at L
                rows = np.arange(qb * block_size, qb * block_size + len(q))
                m_i = np.full(len(q), -np.inf)
                l_i = np.zeros(len(q))
                acc = np.zeros((len(q), V.shape[-1]))
                last = qb if causal else n - 1
                for kb in range(last + 1):
                    k = K[b, j, kb * block_size:(kb + 1) * block_size]
                    s = q @ k.T / d ** 0.5  # (bq, bk)
                    if causal:
                        cols = np.arange(kb * block_size, kb * block_size + len(k))
                        s[cols[None, :] > rows[:, None]] = -np.inf
                    m_new = np.maximum(m_i, s.max(axis=1))
                    p = np.exp(s - m_new[:, None])
                    scale = np.exp(m_i - m_new)
                    l_i *= scale
                    l_i += p.sum(axis=1)
                    acc *= scale[:, None]
                    acc += p @ V[b, j, kb * block_size:(kb + 1) * block_size]
                    m_i = m_new
                out[b, j, rows] = acc / l_i[:, None]
    return out
'''

VARIANTS = [
    Variant("prescaled Q, einsum heads, no try/finally",
            {"measure_peak": PEAK_NO_FINALLY, HBH: HBH_EINSUM_NEW_ARRAYS, CHUNKED: CHUNKED_PRESCALED_Q}),
    Variant("key blocks outer with O(L d) state, heads concatenated",
            {"measure_peak": PEAK_RESET, HBH: HBH_CONCAT_HEADS, CHUNKED: CHUNKED_KEYS_OUTER}),
    Variant("2-D tiles per sequence and head, in-place state",
            {HBH: HBH_PER_SEQUENCE, CHUNKED: CHUNKED_PER_HEAD_2D}),
]

# --- bugs that show only for a batch above 1: each must fail a visible test (``breaks``) of the release ---
# (measure_peak has no batch.)

BATCH_MUTANTS = [
    Mutant("head_by_head_forward: every sequence reads the first one's keys", HBH,
           "S = Q @ K.transpose(0, 2, 1)", "S = Q @ K[0].T",
           {"head_by_head_forward_values", "head_by_head_forward_mask", "head_by_head_forward_stability"}, "batch"),
    Mutant("chunked_attention: every sequence reads the first one's keys", CHUNKED,
           "S = q @ K[:, :, ks:ke].transpose(0, 1, 3, 2)", "S = q @ K[:1, :, ks:ke].transpose(0, 1, 3, 2)",
           {"chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability"}, "batch"),
]
