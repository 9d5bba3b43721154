"""One-bug variants of the ps6_ring_speculative solution, each with the tests cells it must fail;
and correct solutions written differently, which must keep every point."""

from tests.mutants import Mutant, Variant

STATE, MERGE, ZIGZAG, SOURCE = "ans_block_state", "ans_merge_states", "ans_zigzag_chunks", "ans_ring_source"
RING, RESIDUAL, STEP = "ans_ring_attention", "ans_residual", "ans_speculative_step"
STATE_CELLS = {"block_state_values", "block_state_causal"}
MERGE_CELLS = {"merge_values", "merge_large"}
STEP_CELLS = {"step_accepted", "step_tokens", "step_distribution"}

MUTANTS = [
    Mutant("block_state: scores not scaled", STATE,
           "s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])", "s = q @ np.swapaxes(k, -1, -2)",
           breaks=STATE_CELLS, feedback="scale the scores by 1/sqrt(d)"),
    Mutant("block_state: causal mask hides the diagonal", STATE, "np.tril(np.ones(s.shape[-2:], dtype=bool))",
           "np.tril(np.ones(s.shape[-2:], dtype=bool), -1)", breaks={"block_state_causal"},
           feedback="itself included"),
    Mutant("merge: states merged without rescaling", MERGE, "return m, a * l_a + b * l_b, a * acc_a + b * acc_b",
           "return m, l_a + l_b, acc_a + acc_b", breaks=MERGE_CELLS, feedback="relative to its own maximum"),
    Mutant("merge: exp of the raw maxima", MERGE, "a, b = np.exp(m_a - m), np.exp(m_b - m)",
           "a, b = np.exp(m_a) / np.exp(m), np.exp(m_b) / np.exp(m)", breaks={"merge_large"}, feedback="overflows"),
    Mutant("zigzag: late chunk off by one", ZIGZAG, "return rank, 2 * world_size - 1 - rank",
           "return rank, 2 * world_size - rank", breaks={"zigzag_chunks"}, feedback="counted from 0 to 2N - 1"),
    Mutant("zigzag: late chunk not mirrored", ZIGZAG, "return rank, 2 * world_size - 1 - rank",
           "return rank, world_size + rank", breaks={"zigzag_chunks"}, feedback="mirrors its early one"),
    Mutant("ring_source: off-by-one rank order", SOURCE, "return (rank - step) % world_size",
           "return (rank - step - 1) % world_size", breaks={"ring_source"}, feedback="at step 0 a rank holds its own"),
    Mutant("ring_source: blocks passed backwards", SOURCE, "return (rank - step) % world_size",
           "return (rank + step) % world_size", breaks={"ring_source"}, feedback="blocks move to the next rank"),
    Mutant("ring: a higher rank's block skipped", RING,
           "merged = merge_states(*late, *block_state(q[..., c:, :], k, v))", "merged = late",
           breaks={"ring_causal"}, feedback="not all in the future"),
    Mutant("ring: the causal cases swapped", RING, "elif src < rank:", "elif src > rank:",
           breaks={"ring_causal"}, feedback="the two cases are swapped"),
    Mutant("residual: not normalised", RESIDUAL, "return r / r.sum(axis=-1, keepdims=True)", "return r",
           breaks={"residual_values"}, feedback="so that it is a distribution"),
    Mutant("residual: q - p", RESIDUAL, "r = np.maximum(p - q, 0.0)", "r = np.maximum(q - p, 0.0)",
           breaks={"residual_values"}, feedback="more mass than the draft"),
    Mutant("step: accepted with the ratio q/p", STEP, "min(1.0, p[b, n, x] / q[b, n, x])",
           "min(1.0, q[b, n, x] / p[b, n, x])", breaks=STEP_CELLS,
           feedback="the target's probability over the draft's"),
    Mutant("step: replacement drawn from p, not the residual", STEP,
           "dist = residual(p[b, n], q[b, n]) if n < k else p[b, k]", "dist = p[b, n]",
           breaks={"step_tokens", "step_distribution"}, feedback="draw from the residual"),
]

# --- correct solutions written differently ------------------------------------------------------

STATE_EINSUM = '''def block_state(q, k, v, causal=False):
    """Scores by einsum; the mask by comparing positions."""
    s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        i, j = np.indices(s.shape[-2:])
        s[..., j > i] = -np.inf
    m = np.max(s, axis=-1)[..., None]
    w = np.exp(s - m)
    return m, np.sum(w, axis=-1)[..., None], np.einsum("...qk,...kd->...qd", w, v)
'''

MERGE_LSE = '''def merge_states(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Through each state's log-sum-exp, then back to the common maximum."""
    m = np.maximum(m_a, m_b)
    wa, wb = np.exp(m_a + np.log(l_a) - m), np.exp(m_b + np.log(l_b) - m)
    return m, wa + wb, wa * (acc_a / l_a) + wb * (acc_b / l_b)
'''

ZIGZAG_LIST = '''def zigzag_chunks(world_size, rank):
    """Chunk r from the front, chunk r from the back."""
    order = list(range(2 * world_size))
    return order[rank], order[::-1][rank]
'''

SOURCE_ADD = '''def ring_source(world_size, rank, step):
    """Kept non-negative before the modulo."""
    return (rank + world_size - step % world_size) % world_size
'''

RING_CHUNK_PAIRS = '''def ring_attention(Q, K, V, world_size, causal=False):
    """Every rank, every step; with the mask, chunk by chunk: a key chunk before a query chunk counts whole."""
    N, L = world_size, Q.shape[-2]
    per = 2 if causal else 1
    c = L // (per * N)
    chunks = [list(zigzag_chunks(N, r)) if causal else [r] for r in range(N)]
    rows = lambda i: slice(i * c, (i + 1) * c)
    out = np.empty_like(Q)
    for r in range(N):
        states = {}
        for step in range(N):
            src = ring_source(N, r, step)
            for qi in chunks[r]:
                for ki in chunks[src]:
                    if causal and ki > qi:
                        continue
                    new = block_state(Q[..., rows(qi), :], K[..., rows(ki), :], V[..., rows(ki), :],
                                      causal and ki == qi)
                    states[qi] = new if qi not in states else merge_states(*states[qi], *new)
        for qi, (m, l, acc) in states.items():
            out[..., rows(qi), :] = acc / l
    return out
'''

RESIDUAL_CLIP = '''def residual(p, q):
    """Clipped, then divided by its total."""
    excess = np.clip(p - q, 0, None)
    return excess / np.sum(excess, axis=-1)[..., None]
'''

STEP_VECTOR = '''def speculative_step(p, q, drafted, u, r):
    """All acceptances at once; the first rejection found with a running product."""
    B, k = drafted.shape
    rows = np.arange(B)[:, None]
    steps = np.arange(k)[None, :]
    ratio = p[rows, steps, drafted] / q[rows, steps, drafted]
    kept = np.cumprod(u < np.minimum(1, ratio), axis=1)  # 1 while every draft so far was accepted
    n_accepted = kept.sum(axis=1).astype(int)
    tokens = []
    for b, n in enumerate(n_accepted):
        tokens.append(sample_token(p[b, k] if n == k else residual(p[b, n], q[b, n]), r[b]))
    return n_accepted, np.array(tokens, dtype=int)
'''

STATE_LOOP = '''def block_state(q, k, v, causal=False):
    """The scores once, masked with np.triu's complement."""
    d = q.shape[-1]
    s = np.matmul(q, np.moveaxis(k, -1, -2)) * d ** -0.5
    if causal:
        s = s + np.triu(np.full(s.shape[-2:], -np.inf), 1)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return m, e.sum(-1, keepdims=True), np.matmul(e, v)
'''

MERGE_WHERE = '''def merge_states(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """The state with the smaller maximum rescaled to the other's; the other keeps its weight of 1."""
    a_top = m_a >= m_b
    m = np.where(a_top, m_a, m_b)
    wa = np.where(a_top, 1.0, np.exp(m_a - m_b))
    wb = np.where(a_top, np.exp(m_b - m_a), 1.0)
    return m, wa * l_a + wb * l_b, wa * acc_a + wb * acc_b
'''

RING_STEPS_OUTER = '''def ring_attention(Q, K, V, world_size, causal=False):
    """As the ranks run it: at each step every rank works on the block it holds, then the blocks move on."""
    N = world_size
    c = Q.shape[-2] // (2 * N if causal else N)
    pos = []
    for r in range(N):
        ids = zigzag_chunks(N, r) if causal else [r]
        pos.append(np.concatenate([np.arange(i * c, i * c + c) for i in ids]))
    q = [Q[..., p, :] for p in pos]
    held = [(K[..., p, :], V[..., p, :]) for p in pos]
    state = [block_state(q[r], *held[r], causal) for r in range(N)]
    for step in range(1, N):
        held = [held[(r - 1) % N] for r in range(N)]  # each rank receives from the one before it
        for r in range(N):
            k, v = held[r]
            src = ring_source(N, r, step)
            if not causal:
                state[r] = merge_states(*state[r], *block_state(q[r], k, v))
            elif src < r:
                state[r] = merge_states(*state[r], *block_state(q[r], k[..., :c, :], v[..., :c, :]))
            else:
                m, l, acc = (x.copy() for x in state[r])
                m[..., c:, :], l[..., c:, :], acc[..., c:, :] = merge_states(
                    m[..., c:, :], l[..., c:, :], acc[..., c:, :], *block_state(q[r][..., c:, :], k, v))
                state[r] = (m, l, acc)
    out = np.zeros_like(Q)
    for r in range(N):
        out[..., pos[r], :] = state[r][2] / state[r][1]
    return out
'''

STEP_FOR_ELSE = '''def speculative_step(p, q, drafted, u, r):
    """for ... else: the else runs when no draft was rejected."""
    n_out, tok_out = [], []
    for b in range(len(drafted)):
        k = len(drafted[b])
        for i, x in enumerate(drafted[b]):
            if not u[b][i] < min(1.0, p[b][i][x] / q[b][i][x]):
                n_out.append(i)
                tok_out.append(sample_token(residual(p[b][i], q[b][i]), r[b]))
                break
        else:
            n_out.append(k)
            tok_out.append(sample_token(p[b][k], r[b]))
    return np.array(n_out), np.array(tok_out)
'''

VARIANTS = [
    Variant("einsum, log-sum-exp merge, list zigzag, chunk pairs, clipped residual, vectorised rule",
            {STATE: STATE_EINSUM, MERGE: MERGE_LSE, ZIGZAG: ZIGZAG_LIST, SOURCE: SOURCE_ADD, RING: RING_CHUNK_PAIRS,
             RESIDUAL: RESIDUAL_CLIP, STEP: STEP_VECTOR}),
    Variant("triu mask, weights by np.where, steps outer, for-else rule",
            {STATE: STATE_LOOP, MERGE: MERGE_WHERE, RING: RING_STEPS_OUTER, STEP: STEP_FOR_ELSE}),
    Variant("the solution's ring, chunk pairs elsewhere", {RING: RING_CHUNK_PAIRS, STEP: STEP_FOR_ELSE,
                                                          RESIDUAL: RESIDUAL_CLIP}),
]

# --- bugs that show only for a batch above 1: each must fail a visible test (``breaks``) of the release ---

BATCH_MUTANTS = [
    Mutant("block_state: one maximum for the whole batch", STATE, "m = s.max(axis=-1, keepdims=True)",
           "m = s.max(axis=(0, -1), keepdims=True)", {"block_state_values", "block_state_causal"}, "batch"),
    Mutant("merge_states: one maximum for the whole batch", MERGE, "m = np.maximum(m_a, m_b)",
           "m = np.maximum(m_a, m_b).max(axis=0)", {"merge_values", "merge_large", "ring_causal"}, "batch"),
    Mutant("ring_attention: output without the batch axis", RING, "out = np.zeros(Q.shape)",
           "out = np.zeros(Q.shape[1:])", {"ring_values", "ring_causal"}, "batch"),
    Mutant("residual: normalised over the whole batch", RESIDUAL, "return r / r.sum(axis=-1, keepdims=True)",
           "return r / r.sum()", {"residual_values"}, "batch"),
    Mutant("speculative_step: every sequence reads the first one's drafts", STEP, "x = drafted[b, n]",
           "x = drafted[0, n]", {"step_distribution"}, "batch"),
]
