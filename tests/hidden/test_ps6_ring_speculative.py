"""Hidden checks of ps6_ring_speculative: one block's online-softmax state, the merge of two states, the zigzag
split, the ring's order, ring attention over simulated ranks, the residual and the speculative acceptance rule.

Each check: (1) draw inputs anew in every grading run (``checks.fresh_inputs``), on shapes the visible tests do not
use, (2) call the student's function, (3) judge it against mha_lab's reference: ``mha_lab.parallel.sequence``
(``block_state``, ``merge_states``, ``zigzag_chunks``, ``ring_source``, ``ring_attention``) and
``mha_lab.cpu.speculative`` (``residual``, and ``verify`` with the given uniform numbers). To name a bug, the judge
compares a wrong answer with what each known bug gives. Ring attention is judged with the reference pieces of
tasks 1-4 in place of the student's, the acceptance rule with the reference ``residual``, so that a bug costs its
points only in its own task.
"""

import numpy as np

from mha_lab.cpu import create_causal_mask, scaled_dot_product_attention
from mha_lab.cpu.speculative import UniformDraw, verify
from mha_lab.cpu.speculative import residual as reference_residual
from mha_lab.grading import checks
from mha_lab.grading.references import Array, Choice, Number, Reference
from mha_lab.parallel.sequence import (
    block_state,
    merge_states,
    ring_part,
    ring_source,
    shard_sequence,
    unshard_sequence,
)

# the package's own code for each task (the book prints it): what the class report's similarity compares answers with
PACKAGE_ANSWERS = {"block_state": ["mha_lab.parallel.sequence.block_state"],
                   "merge_states": ["mha_lab.parallel.sequence.merge_states"],
                   "zigzag_chunks": ["mha_lab.parallel.sequence.zigzag_chunks"],
                   "ring_source": ["mha_lab.parallel.sequence.ring_source"],
                   "ring_attention": ["mha_lab.parallel.sequence.ring_attention",
                                      "mha_lab.parallel.sequence.rank_partials"],
                   "residual": ["mha_lab.cpu.speculative.residual"],
                   "speculative_step": ["mha_lab.cpu.speculative.verify"]}
_ARRAY = Array((1, 6))
_INT = Number(0, 4096, integer=True)
REFERENCE_PIECES = {
    "block_state": Reference("mha_lab.parallel.sequence.block_state",
                             (("q", _ARRAY), ("k", _ARRAY), ("v", _ARRAY), ("causal", Choice((False, True)))), 3),
    "merge_states": Reference("mha_lab.parallel.sequence.merge_states",
                              tuple((n, _ARRAY) for n in ("m_a", "l_a", "acc_a", "m_b", "l_b", "acc_b")), 6),
    "zigzag_chunks": Reference("mha_lab.parallel.sequence.zigzag_chunks",
                               (("world_size", Number(1, 4096, integer=True)), ("rank", _INT)), 2),
    "ring_source": Reference("mha_lab.parallel.sequence.ring_source",
                             (("world_size", Number(1, 4096, integer=True)), ("rank", _INT), ("step", _INT)), 3)}
REFERENCE_RESIDUAL = {"residual": Reference("mha_lab.cpu.speculative.residual",
                                            (("p", Array((1, 1))), ("q", Array((1, 1)))), 2)}
_rng = checks.fresh_inputs()  # new inputs in every grading run


def _same(out, candidate) -> bool:
    return np.shape(out) == np.shape(candidate) and bool(np.allclose(out, candidate, rtol=1e-8, atol=1e-10))


def _qkv(key: int, B: int, h: int, Lq: int, Lk: int, d: int, scale: float = 1.0):
    rng = _rng(key)
    return scale * rng.standard_normal((B, h, Lq, d)), rng.standard_normal((B, h, Lk, d)), \
        rng.standard_normal((B, h, Lk, d))


# --- task 1: block_state ---------------------------------------------------------------------------

STATE_HINT = ("s = q . k / sqrt(d); m = max_j s_j per query; l = sum_j exp(s_j - m); acc = sum_j exp(s_j - m) v_j, "
              "not divided by l [bug: block-state]")


def _state_hint(got, q, k, v, causal) -> str:
    unscaled = block_state(q * np.sqrt(q.shape[-1]), k, v, causal)
    if all(_same(g, w) for g, w in zip(got, unscaled, strict=True)):
        return "scale the scores by 1/sqrt(d) before the maximum and the exponentials [bug: unscaled-scores]"
    want = block_state(q, k, v, causal)
    if _same(got[2], want[2] / want[1]):
        return "acc is the sum of exp(s_j - m) v_j, not yet divided by l: the merge needs it that way " \
               "[bug: acc-normalised]"
    return STATE_HINT


def _check_state(student, key, B, h, Lq, Lk, d, causal=False):
    q, k, v = _qkv(key, B, h, Lq, Lk, d)
    want = block_state(q, k, v, causal)
    what = f"block_state of q {q.shape} over {Lk} keys{' (causal)' if causal else ''}"
    got = checks.call(student, "block_state", q, k, v, causal)
    checks.expect_true(isinstance(got, tuple | list) and len(got) == 3,
                       what=f"{what}: expected a tuple (m, l, acc), got {type(got).__name__}",
                       hint="return m, l, acc [bug: return-state]")
    strict = ("query i sees keys 0..i, itself included: mask only the scores above the diagonal (the first query "
              "must keep its own key) [bug: causal-mask-strict]")
    for name, g, w in zip(("m", "l", "acc"), got, want, strict=True):
        checks.expect_array(g, what=f"{what}: {name}", shape=w.shape, **({"hint": strict} if causal else {}))
    hint = _state_hint(got, q, k, v, causal)
    for name, g, w in zip(("m", "l", "acc"), got, want, strict=True):
        checks.expect_close(g, w, what=f"{what}: {name}", hint=hint)


def test_block_state_values(student):
    _check_state(student, 1, 3, 2, 4, 9, 6)


def test_block_state_values__one_key(student):
    _check_state(student, 2, 2, 1, 3, 1, 5)


def test_block_state_causal(student):
    _check_state(student, 3, 2, 3, 7, 7, 4, causal=True)


def test_block_state_causal__one_position(student):
    _check_state(student, 4, 3, 1, 1, 1, 8, causal=True)


# --- task 2: merge_states --------------------------------------------------------------------------

def _merge_hint(got, a, b) -> str:
    if _same(got[1], a[1] + b[1]) or _same(got[2], a[2] + b[2]):
        return ("each state's l and acc are relative to its own maximum: multiply them by exp(m_a - m) and "
                "exp(m_b - m) before adding them [bug: merged-without-rescaling]")
    return ("m = max(m_a, m_b); l = exp(m_a - m) l_a + exp(m_b - m) l_b; acc = exp(m_a - m) acc_a + "
            "exp(m_b - m) acc_b [bug: merge-formula]")


def _check_merge(student, key, B, h, L, d, keys_a, keys_b, scale=1.0):
    q, k, v = _qkv(key, B, h, L, keys_a + keys_b, d, scale)
    a, b = block_state(q, k[..., :keys_a, :], v[..., :keys_a, :]), block_state(q, k[..., keys_a:, :],
                                                                                 v[..., keys_a:, :])
    what = f"merge_states of two states of q {q.shape} over {keys_a} and {keys_b} keys" + (
        f", scores scaled by {scale:g}" if scale != 1 else "")
    got = checks.call(student, "merge_states", *a, *b)
    checks.expect_true(isinstance(got, tuple | list) and len(got) == 3,
                       what=f"{what}: expected a tuple (m, l, acc), got {type(got).__name__}",
                       hint="return m, l, acc [bug: return-state]")
    want = merge_states(*a, *b)
    overflow = ("exp of a maximum in the hundreds overflows: rescale by exp(m_a - m), a difference, never by "
                "exp(m_a) / exp(m) [bug: exp-overflow]")
    for name, g, w in zip(("m", "l", "acc"), got, want, strict=True):
        checks.expect_array(g, what=f"{what}: {name}", shape=w.shape, hint=overflow)
    hint = _merge_hint(got, a, b)
    for name, g, w in zip(("m", "l", "acc"), got, want, strict=True):
        checks.expect_close(g, w, what=f"{what}: {name}", hint=hint)
    expected = scaled_dot_product_attention(q, k, v)[0]
    checks.expect_close(np.asarray(got[2]) / np.asarray(got[1]), expected,
                        what=f"{what}: acc / l vs attention over all the keys", hint=hint)


def test_merge_values(student):
    _check_merge(student, 5, 2, 3, 4, 5, keys_a=6, keys_b=3)


def test_merge_values__one_key_each(student):
    _check_merge(student, 6, 3, 1, 2, 4, keys_a=1, keys_b=1)


def test_merge_large(student):
    _check_merge(student, 7, 2, 2, 3, 6, keys_a=5, keys_b=7, scale=400.0)


# --- task 3: zigzag_chunks -------------------------------------------------------------------------

def test_zigzag_chunks(student):
    sizes = sorted({int(n) for n in _rng(8).integers(1, 17, size=3)} | {1, 2})
    for n in sizes:
        for r in range(n):
            got = checks.call(student, "zigzag_chunks", n, r)
            ok = isinstance(got, tuple | list) and len(got) == 2 and all(
                isinstance(i, int | np.integer) for i in got)
            checks.expect_true(ok, what=f"zigzag_chunks({n}, {r}): expected a tuple of two chunk indices, got "
                               f"{str(got)[:60]}", hint="return (early, late) [bug: return-chunks]")
            if tuple(got) == (r, 2 * n - r):
                hint = "chunks are counted from 0 to 2N - 1: the late one is 2N - 1 - r [bug: zigzag-off-by-one]"
            elif tuple(got) == (r, n + r):
                hint = ("rank r's late chunk mirrors its early one, 2N - 1 - r, so that early and late work "
                        "balance [bug: zigzag-not-mirrored]")
            else:
                hint = "rank r holds chunks r and 2N - 1 - r, the early one first [bug: zigzag-chunks]"
            checks.expect_true(tuple(int(i) for i in got) == (r, 2 * n - 1 - r),
                               what=f"zigzag_chunks({n}, {r}) returned {tuple(got)}, expected (r, 2N - 1 - r) = "
                                    f"({r}, {2 * n - 1 - r})", hint=hint)


# --- task 4: ring_source ---------------------------------------------------------------------------

def test_ring_source(student):
    sizes = sorted({int(n) for n in _rng(9).integers(2, 13, size=3)} | {1, 3})
    for n in sizes:
        for r in range(n):
            got = [checks.call(student, "ring_source", n, r, s) for s in range(n)]
            want = [ring_source(n, r, s) for s in range(n)]
            if got == [(r + s) % n for s in range(n)]:
                hint = ("blocks move to the next rank, r + 1, so rank r receives from r - 1: at step s it holds "
                        "rank r - s's block [bug: ring-direction]")
            elif got == [(r - s - 1) % n for s in range(n)] or got == [(r - s + 1) % n for s in range(n)]:
                hint = "at step 0 a rank holds its own block: the source is (r - s) mod N [bug: rank-order-off-by-one]"
            else:
                hint = "at step s rank r holds the block of rank (r - s) mod N [bug: ring-source]"
            checks.expect_true(got == want, what=f"ring_source({n}, {r}, s) for s = 0..{n - 1}: got {got}, expected "
                               f"{want}", hint=hint)


# --- task 5: ring_attention ------------------------------------------------------------------------

def _ring_with(Q, K, V, n, *, skip_later=False, swapped=False):
    """What causal ring attention gives with a known bug: a higher rank's block skipped, or the two cases swapped.
    Shapes: Q, K, V (B, h, L, d) -> (B, h, L, d)."""
    blocks = [shard_sequence(x, n, zigzag=True) for x in (Q, K, V)]
    half, outs = blocks[0][0].shape[-2] // 2, []
    for r in range(n):
        q = blocks[0][r]
        m, l, acc = block_state(q, blocks[1][r], blocks[2][r], True)
        for step in range(1, n):
            src = ring_source(n, r, step)
            k, v = blocks[1][src], blocks[2][src]
            early = (ring_part(n, r, step, True) == "first keys") != swapped
            if early:
                m, l, acc = merge_states(m, l, acc, *block_state(q, k[..., :half, :], v[..., :half, :]))
            elif not skip_later:
                late = merge_states(m[..., half:, :], l[..., half:, :], acc[..., half:, :],
                                    *block_state(q[..., half:, :], k, v))
                m, l, acc = (np.concatenate([x[..., :half, :], y], axis=-2) for x, y in zip((m, l, acc), late,
                                                                                           strict=True))
        outs.append(acc / l)
    return unshard_sequence(outs, zigzag=True)


def _ring_hint(out, Q, K, V, n, causal) -> str:
    if causal and _same(out, _ring_with(Q, K, V, n, skip_later=True)):
        return ("a block from a higher rank is not all in the future: its chunks come before this rank's late "
                "chunk, so merge it into the late chunk's state [bug: higher-rank-block-skipped]")
    if causal and _same(out, _ring_with(Q, K, V, n, swapped=True)):
        return ("a lower rank's block counts through its early chunk for both query chunks, a higher rank's "
                "whole block for the late query chunk only: the two cases are swapped [bug: causal-cases-swapped]")
    if causal and _same(out, scaled_dot_product_attention(Q, K, V)[0]):
        return "with causal=True every query sees only the keys at or before it [bug: mask-ignored]"
    return ("each rank starts from its own block's state, merges every other rank's block in ring order (the "
            "parts the mask allows when causal), and divides acc by l once, at the end [bug: ring-attention]")


def _check_ring(student, key, B, h, n, chunk, d, causal=False):
    L = (2 * n if causal else n) * chunk
    Q, K, V = _qkv(key, B, h, L, L, d)
    expected = scaled_dot_product_attention(Q, K, V, create_causal_mask(L) if causal else None)[0]
    what = f"ring_attention on {n} ranks, (B, h, L, d) = {Q.shape}{', causal' if causal else ''}"
    out = checks.call_replacing(student, REFERENCE_PIECES, "ring_attention", Q, K, V, n, causal)
    checks.expect_array(out, what=what, shape=expected.shape)
    checks.expect_close(out, expected, what=f"{what} vs attention over the whole sequence",
                        hint=_ring_hint(out, Q, K, V, n, causal))


def test_ring_values(student):
    _check_ring(student, 10, 2, 3, 4, 3, 5)


def test_ring_values__one_rank(student):
    _check_ring(student, 11, 1, 2, 1, 5, 4)


def test_ring_values__five_ranks(student):
    _check_ring(student, 12, 3, 1, 5, 2, 3)


def test_ring_causal(student):
    _check_ring(student, 13, 2, 2, 4, 3, 4, causal=True)


def test_ring_causal__two_ranks(student):
    _check_ring(student, 14, 3, 1, 2, 1, 6, causal=True)


def test_ring_causal__five_ranks(student):
    _check_ring(student, 15, 1, 3, 5, 2, 4, causal=True)


# --- task 6: residual ------------------------------------------------------------------------------

def _distributions(key, shape, V):
    rng = _rng(key)
    return rng.dirichlet(np.ones(V), size=shape), rng.dirichlet(np.ones(V), size=shape)


def test_residual_values(student):
    for key, shape, V in ((16, (4,), 7), (17, (2, 3), 4), (18, (), 9)):
        p, q = _distributions(key, shape, V)
        want = np.maximum(p - q, 0.0)
        want /= want.sum(axis=-1, keepdims=True)
        what = f"residual of p, q {p.shape}"
        got = checks.call(student, "residual", p, q)
        checks.expect_array(got, what=what, shape=p.shape)
        if _same(got, np.maximum(p - q, 0.0)):
            hint = "divide max(0, p - q) by its sum over the last axis, so that it is a distribution [bug: " \
                   "residual-not-normalised]"
        elif _same(got, np.maximum(q - p, 0.0) / np.maximum(q - p, 0.0).sum(axis=-1, keepdims=True)):
            hint = ("the residual is where the target has more mass than the draft: max(0, p - q) "
                    "[bug: residual-q-minus-p]")
        else:
            hint = "residual = max(0, p - q) / sum over the last axis of max(0, p - q) [bug: residual-formula]"
        checks.expect_close(got, want, what=what, hint=hint)
        if p.ndim == 1:
            checks.expect_close(got, reference_residual(p, q), what=f"{what} vs mha_lab's", hint=hint)


# --- task 7: speculative_step ----------------------------------------------------------------------

def _inverse_cdf(probs, r) -> int:
    return UniformDraw([], r).sample(probs)


def _rule(p, q, drafted, u, r, *, ratio="p/q", replacement="residual"):
    """The rule row by row, with a known bug when asked: (n_accepted, next_token), each (B,)."""
    n_out, tok_out = [], []
    for b in range(len(drafted)):
        if ratio == "p/q" and replacement == "residual":
            toks = verify(p[b], q[b], list(drafted[b]), UniformDraw(u[b], r[b]))
            n_out.append(len(toks) - 1)
            tok_out.append(toks[-1])
            continue
        n = 0
        while n < drafted.shape[1]:
            x = drafted[b, n]
            a = min(1.0, q[b, n, x] / p[b, n, x]) if ratio == "q/p" else min(1.0, p[b, n, x] / q[b, n, x])
            if u[b, n] >= a:
                break
            n += 1
        dist = reference_residual(p[b, n], q[b, n]) if n < drafted.shape[1] and replacement == "residual" \
            else p[b, n]
        n_out.append(n)
        tok_out.append(_inverse_cdf(dist, r[b]))
    return np.array(n_out), np.array(tok_out)


def _spec_problem(key, B, k, V):
    rng = _rng(key)
    p = rng.dirichlet(np.full(V, 0.5), size=(B, k + 1))
    q = rng.dirichlet(np.full(V, 0.5), size=(B, k))
    drafted = np.array([[int(rng.choice(V, p=q[b, i])) for i in range(k)] for b in range(B)])
    return p, q, drafted, rng.random((B, k)), rng.random(B)


def _call_step(student, args, what):
    got = checks.call_replacing(student, REFERENCE_RESIDUAL, "speculative_step", *args)
    checks.expect_true(isinstance(got, tuple | list) and len(got) == 2,
                       what=f"{what}: expected (n_accepted, next_token), got {type(got).__name__}",
                       hint="return n_accepted, next_token [bug: return-step]")
    B = len(args[2])
    for name, g in zip(("n_accepted", "next_token"), got, strict=True):
        checks.expect_true(isinstance(g, np.ndarray) and g.shape == (B,) and g.dtype.kind in "iu",
                           what=f"{what}: {name} should be an integer array of shape ({B},), got "
                                f"{getattr(g, 'dtype', type(g).__name__)} {np.shape(g)}",
                           hint="return two integer arrays of shape (B,) [bug: return-step]")
    return got


RATIO_HINT = ("accept draft x when u < min(1, p(x) / q(x)): the target's probability over the draft's "
              "[bug: wrong-acceptance-ratio]")
RESIDUAL_HINT = ("after a rejection draw from the residual max(0, p - q), normalised, not from p: the accepted drafts "
                 "already gave the tokens where q covers p [bug: not-resampling-from-residual]")


def _step_hint(got, args, part) -> str:
    index = 0 if part == "accepted" else 1
    if np.array_equal(got[index], _rule(*args, ratio="q/p")[index]):
        return RATIO_HINT
    if part == "tokens" and np.array_equal(got[1], _rule(*args, replacement="target")[1]):
        return RESIDUAL_HINT
    if part == "accepted":
        return "go through the drafts in order, accept while u[b, i] < min(1, p[b, i, x] / q[b, i, x]), stop at " \
               "the first rejection [bug: acceptance-rule]"
    return "after a rejection at draft i draw with sample_token(residual(p[b, i], q[b, i]), r[b]); after k " \
           "acceptances with sample_token(p[b, k], r[b]) [bug: next-token]"


def _check_step(student, key, B, k, V, part):
    args = _spec_problem(key, B, k, V)
    want = _rule(*args)
    what = f"speculative_step on B={B} sequences of k={k} drafts over V={V} tokens"
    got = _call_step(student, args, what)
    index = 0 if part == "accepted" else 1
    checks.expect_true(np.array_equal(got[index], want[index]),
                       what=f"{what}: {('drafts kept', 'next tokens')[index]} {np.asarray(got[index]).tolist()}, "
                            f"expected {want[index].tolist()}", hint=_step_hint(got, args, part))


def test_step_accepted(student):
    _check_step(student, 19, 40, 3, 6, "accepted")


def test_step_accepted__one_draft(student):
    _check_step(student, 20, 25, 1, 3, "accepted")


def test_step_tokens(student):
    _check_step(student, 21, 40, 3, 6, "tokens")


def test_step_tokens__long_drafts(student):
    _check_step(student, 22, 20, 6, 4, "tokens")


def _first_token_law(p, q, *, ratio="p/q", replacement="residual"):
    """The exact distribution of the first token out of one draft x ~ q, with a known bug when asked."""
    accept = np.minimum(1.0, q / p if ratio == "q/p" else p / q)  # (V,): by drafted token
    rejected = float(np.sum(q * (1 - accept)))
    return q * accept + rejected * (reference_residual(p, q) if replacement == "residual" else p)


def _distinct_pair(key):
    """A target p and a draft q over a few tokens, drawn until each known bug moves the first token's law by 0.12."""
    rng = _rng(key)
    while True:
        V = int(rng.integers(3, 6))
        p, q = rng.dirichlet(np.ones(V)), rng.dirichlet(np.full(V, 0.3))
        if min(np.abs(_first_token_law(p, q, **bug) - p).max()
               for bug in ({"ratio": "q/p"}, {"replacement": "target"})) > 0.12:
            return p, q


def test_step_distribution(student):
    """The first token out, over every drafted token (weighted by q) and a grid of (u, r): the target's p."""
    p, q = _distinct_pair(23)
    V, grid = len(p), (np.arange(48) + 0.5) / 48
    x, u, r = (a.ravel() for a in np.meshgrid(np.arange(V), grid, grid, indexing="ij"))
    B = len(x)
    args = (np.tile(p, (B, 2, 1)), np.tile(q, (B, 1, 1)), x[:, None], u[:, None], r)
    what = f"the first token out of speculative_step, over every draft x ~ q and a 48 x 48 grid of (u, r), V={V}"
    n, tok = _call_step(student, args, what)
    law = np.bincount(np.where(n >= 1, x, tok), weights=q[x] / 48**2, minlength=V)[:V]
    if np.abs(law - _first_token_law(p, q, ratio="q/p")).max() < 0.04:
        hint = RATIO_HINT
    elif np.abs(law - _first_token_law(p, q, replacement="target")).max() < 0.04:
        hint = RESIDUAL_HINT
    else:
        hint = "accept while u < min(1, p / q), replace the first rejected draft from the residual " \
               "[bug: acceptance-rule]"
    checks.expect_true(np.abs(law - p).max() < 0.04,
                       what=f"{what}: distributed as {np.round(law, 3).tolist()}, not as the target's p = "
                            f"{np.round(p, 3).tolist()}", hint=hint)
