"""One-bug variants of the ps5_decoding solution, each with the tests cells it must fail;
and correct solutions written differently, which must keep every point."""

from tests.mutants import Mutant, Variant

ROPE, PAGED, MERGE = "ans_rope", "ans_paged_decode_step", "ans_merge_partials"
PAGED_CELLS = {"paged_decode_values", "paged_decode_sequence"}
MERGE_CELLS = {"merge_values", "merge_large"}

MUTANTS = [
    Mutant("rope: interleaved pairs", ROPE, "a, b = x[..., :half], x[..., half:]", "a, b = x[..., 0::2], x[..., 1::2]",
           breaks={"rope_values"}, feedback="interleaved layout"),
    Mutant("rope: turns the wrong way", ROPE, "[a * cos - b * sin, a * sin + b * cos]",
           "[a * cos + b * sin, b * cos - a * sin]", breaks={"rope_values"}, feedback="turns the wrong way",
           bug="rotation-direction"),
    Mutant("rope: positions ignored", ROPE, "np.asarray(positions, dtype=float)[:, None]",
           "np.arange(x.shape[-2], dtype=float)[:, None]", breaks={"rope_values", "rope_relative"},
           feedback="not by the given positions"),
    Mutant("rope: frequencies without the 2", ROPE, "-2.0 * np.arange(half) / d", "-1.0 * np.arange(half) / d",
           breaks={"rope_values"}, feedback="with the 2"),
    Mutant("paged: position offset not advanced", PAGED, "lengths[b] = p + 1", "lengths[b] = p",
           breaks={"paged_decode_cache", "paged_decode_sequence"}, feedback="advance each sequence's position"),
    Mutant("paged: keys rotated twice", PAGED, "scores = q @ K.transpose(0, 2, 1) / np.sqrt(d_k)",
           "scores = q @ rope(K, np.arange(p + 1)).transpose(0, 2, 1) / np.sqrt(d_k)",
           breaks=PAGED_CELLS, feedback="rotate each key once"),
    Mutant("paged: block table read one page late", PAGED, "table = block_tables[b, :p // block_size + 1]",
           "table = block_tables[b, 1:p // block_size + 2]", breaks=PAGED_CELLS, feedback="one page late"),
    Mutant("paged: query not rotated", PAGED,
           "q = rope((x[b] @ W_Q).reshape(1, num_heads, d_k).transpose(1, 0, 2), [p])",
           "q = (x[b] @ W_Q).reshape(1, num_heads, d_k).transpose(1, 0, 2)",
           breaks=PAGED_CELLS, feedback="rotate the query too"),
    Mutant("paged: key written unrotated", PAGED, "k_pool[block, :, row], v_pool[block, :, row] = k[:, 0], v",
           "k_pool[block, :, row], v_pool[block, :, row] = (x[b] @ W_K).reshape(num_heads, d_k), v",
           breaks={"paged_decode_cache", *PAGED_CELLS}, feedback="rotate k at p"),
    Mutant("paged: scores not scaled by 1/sqrt(d_k)", PAGED, "scores = q @ K.transpose(0, 2, 1) / np.sqrt(d_k)",
           "scores = q @ K.transpose(0, 2, 1)", breaks=PAGED_CELLS, feedback="1/sqrt(d_k) before the softmax",
           bug="scale-missing"),
    Mutant("paged: block and row swapped", PAGED, "block, row = block_tables[b, p // block_size], p % block_size",
           "block, row = block_tables[b, p % block_size], p // block_size",
           breaks={"paged_decode_cache", *PAGED_CELLS}, feedback="block and row are swapped", bug="block-row-swapped"),
    Mutant("rope: positions indexed as an array", ROPE, "np.asarray(positions, dtype=float)[:, None]",
           "positions[:, None].astype(float)", breaks={"rope_values"}, feedback="np.asarray(positions)",
           bug="positions-as-list"),
    Mutant("merge: partial states merged without their max", MERGE,
           "return (w * acc).sum(axis=0) / (w * l).sum(axis=0)", "return acc.sum(axis=0) / l.sum(axis=0)",
           breaks=MERGE_CELLS, feedback="relative to its own maximum"),
    Mutant("merge: exp of the raw maxima", MERGE, "w = np.exp(m - M)", "w = np.exp(m)",
           breaks={"merge_large"}, feedback="overflows"),
    Mutant("merge: average of the chunks' outputs", MERGE, "return (w * acc).sum(axis=0) / (w * l).sum(axis=0)",
           "return (acc / l).mean(axis=0)", breaks=MERGE_CELLS, feedback="weights every chunk equally"),
]

# --- correct solutions written differently ------------------------------------------------------

ROPE_COMPLEX = '''def rope(x, positions):
    """Each pair as one complex number, a + ib, multiplied by exp(i p f)."""
    half = x.shape[-1] // 2
    f = np.exp(-np.log(10000.0) * np.arange(0, x.shape[-1], 2) / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * np.outer(positions, f))
    return np.concatenate([z.real, z.imag], axis=-1)
'''

PAGED_SLOTS = '''def paged_decode_step(x, k_pool, v_pool, block_tables, lengths, W_Q, W_K, W_V, W_O, num_heads):
    """Every position looked up on its own: block and row from the table, one at a time."""
    B, _, d_model = x.shape
    d_k = d_model // num_heads
    bs = k_pool.shape[2]
    k_pool, v_pool = np.array(k_pool), np.array(v_pool)
    new_lengths = np.array(lengths) + 1
    outs = []
    for b in range(B):
        p = int(lengths[b])
        heads = lambda W: (x[b, 0] @ W).reshape(num_heads, 1, d_k)
        q, k = rope(heads(W_Q), [p]), rope(heads(W_K), [p])
        where = [(block_tables[b, j // bs], j % bs) for j in range(p + 1)]
        k_pool[where[p][0], :, where[p][1]] = k[:, 0]
        v_pool[where[p][0], :, where[p][1]] = heads(W_V)[:, 0]
        K = np.stack([k_pool[blk, :, row] for blk, row in where], axis=1)  # (h, p + 1, d_k)
        V = np.stack([v_pool[blk, :, row] for blk, row in where], axis=1)
        w = softmax(np.einsum("hqd,htd->hqt", q, K) / np.sqrt(d_k))
        outs.append(np.einsum("hqt,htd->qhd", w, V).reshape(1, d_model) @ W_O)
    return np.stack(outs), k_pool, v_pool, new_lengths
'''

MERGE_LSE = '''def merge_partials(m, l, acc):
    """By log-sum-exp: chunk c's share of the whole softmax is exp(lse_c - lse)."""
    lse_c = m + np.log(l)  # (S, ..., 1)
    top = lse_c.max(axis=0)
    lse = top + np.log(np.exp(lse_c - top).sum(axis=0))
    return (np.exp(lse_c - lse) * (acc / l)).sum(axis=0)
'''

ROPE_MATRIX = '''def rope(x, positions):
    """A rotation matrix per position, applied with einsum."""
    d = x.shape[-1]
    i = np.arange(d // 2)
    out = np.empty_like(x, dtype=float)
    for n, p in enumerate(positions):
        theta = p / 10000.0 ** (2 * i / d)
        R = np.zeros((d, d))
        R[i, i], R[i, i + d // 2] = np.cos(theta), -np.sin(theta)
        R[i + d // 2, i], R[i + d // 2, i + d // 2] = np.sin(theta), np.cos(theta)
        out[..., n, :] = np.einsum("ij,...j->...i", R, x[..., n, :])
    return out
'''

PAGED_GATHER = '''def paged_decode_step(x, k_pool, v_pool, block_tables, lengths, W_Q, W_K, W_V, W_O, num_heads):
    """All sequences projected at once; each gathers its blocks with np.take and flattens them."""
    B, _, d_model = x.shape
    d_k = d_model // num_heads
    bs = k_pool.shape[2]
    k_pool, v_pool, lengths = k_pool.copy(), v_pool.copy(), np.asarray(lengths).copy()
    Q = (x @ W_Q).reshape(B, num_heads, 1, d_k)
    Kn = (x @ W_K).reshape(B, num_heads, 1, d_k)
    Vn = (x @ W_V).reshape(B, num_heads, d_k)
    out = np.empty((B, 1, d_model))
    for b in range(B):
        pos = lengths[b]
        q, k = rope(Q[b], np.array([pos])), rope(Kn[b], np.array([pos]))
        blk = block_tables[b][pos // bs]
        k_pool[blk, :, pos % bs] = k[:, 0]
        v_pool[blk, :, pos % bs] = Vn[b]
        used = np.take(block_tables[b], np.arange(pos // bs + 1))
        K = np.concatenate([k_pool[u] for u in used], axis=1)[:, : pos + 1]  # (h, p + 1, d_k)
        V = np.concatenate([v_pool[u] for u in used], axis=1)[:, : pos + 1]
        s = (q @ K.swapaxes(1, 2))[:, 0] / np.sqrt(d_k)  # (h, p + 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        out[b, 0] = np.einsum("ht,htd->hd", a, V).ravel() @ W_O
        lengths[b] += 1
    return out, k_pool, v_pool, lengths
'''

MERGE_PAIRWISE = '''def merge_partials(m, l, acc):
    """Fold the chunks in one at a time, as the online softmax folds in key blocks."""
    M, L, A = m[0], l[0], acc[0]
    for c in range(1, m.shape[0]):
        new = np.maximum(M, m[c])
        a, b = np.exp(M - new), np.exp(m[c] - new)
        M, L, A = new, a * L + b * l[c], a * A + b * acc[c]
    return A / L
'''

ROPE_STACK = '''def rope(x, positions):
    """Angles by np.outer; pairs rotated as a stacked (2, ...) array."""
    d = x.shape[-1]
    theta = np.outer(np.asarray(positions, dtype=float), np.power(10000.0, -np.arange(0, d, 2) / d))
    c, s = np.cos(theta), np.sin(theta)
    pair = np.stack([x[..., : d // 2], x[..., d // 2:]])
    rotated = np.stack([c * pair[0] - s * pair[1], s * pair[0] + c * pair[1]])
    return np.moveaxis(rotated, 0, -2).reshape(x.shape)
'''

MERGE_WEIGHTS = '''def merge_partials(m, l, acc):
    """Each chunk's normalised output, weighted by its share exp(m_c - M) l_c of the whole denominator."""
    scale = np.exp(m - np.max(m, axis=0, keepdims=True))
    share = scale * l / np.sum(scale * l, axis=0, keepdims=True)
    return np.sum(share * (acc / l), axis=0)
'''

VARIANTS = [
    Variant("complex numbers, slot by slot, log-sum-exp",
            {ROPE: ROPE_COMPLEX, PAGED: PAGED_SLOTS, MERGE: MERGE_LSE}),
    Variant("rotation matrices, np.take of blocks, pairwise folding",
            {ROPE: ROPE_MATRIX, PAGED: PAGED_GATHER, MERGE: MERGE_PAIRWISE}),
    Variant("stacked pairs, the solution's step, chunk shares", {ROPE: ROPE_STACK, MERGE: MERGE_WEIGHTS}),
]

# --- bugs that show only for a batch above 1: each must fail a visible test (``breaks``) of the release ---

BATCH_MUTANTS = [
    Mutant("rope: pairs concatenated on axis 1", ROPE, "axis=-1)", "axis=1)",
           {"rope_values", "paged_decode_cache", "paged_decode_values", "paged_decode_sequence"}, "batch"),
    Mutant("paged_decode_step: every sequence at the first one's position", PAGED, "p = lengths[b]", "p = lengths[0]",
           {"paged_decode_cache", "paged_decode_values", "paged_decode_sequence"}, "batch"),
    Mutant("merge_partials: one maximum for the whole batch", MERGE, "M = m.max(axis=0)", "M = m.max()",
           {"merge_large"}, "batch"),
]
