"""Hidden checks of ps5_decoding: RoPE, a decoding step through a paged cache, the split-K merge.

Each check: (1) make seeded inputs on shapes the notebook's visible tests do not use, (2) call the
student's function, (3) judge it against mha_lab's reference: ``apply_rope``, the causal forward of
``RotaryAttention``, and ``scaled_dot_product_attention`` over all the keys. To name a bug, the
judge compares a wrong answer with what each known bug gives. The decoding step is judged with the
reference ``rope`` in place of the student's, so that a bug in task 1 costs its points only there.
"""

from dataclasses import dataclass

import numpy as np

from mha_lab.cpu import RotaryAttention, apply_rope, create_causal_mask, scaled_dot_product_attention, split_heads
from mha_lab.cpu.paged import pack_sequences
from mha_lab.cpu.positions import rotate_pairs
from mha_lab.cpu.split_k import split_k_partials
from mha_lab.grading import checks
from mha_lab.grading.references import Array, Reference

# the package's own code for each task (the book prints it): what the class report's similarity compares answers with
PACKAGE_ANSWERS = {"rope": ["mha_lab.cpu.apply_rope", "mha_lab.cpu.positions.rotate_pairs"],
                   "paged_decode_step": ["mha_lab.cpu.paged.paged_decode_step",
                                         "mha_lab.cpu.paged.PagedKVCache.gather"],
                   "merge_partials": ["mha_lab.cpu.split_k.merge_partials"]}
REFERENCE_ROPE = {"rope": Reference("mha_lab.cpu.apply_rope", (
    ("x", Array((1, 5))), ("positions", Array((1, 1), kinds="iuf", listed=True))), 2)}
_rng = checks.fresh_inputs()  # new inputs in every grading run


def _same(out, candidate) -> bool:
    return np.shape(out) == np.shape(candidate) and bool(np.allclose(out, candidate, rtol=1e-8, atol=1e-10))


# --- task 1: rope ----------------------------------------------------------------------------------

ROPE_HINT = ("pair i is (x[..., i], x[..., i + d/2]); at position p it turns by p * 10000**(-2i/d): "
             "x'[i] = x[i] cos - x[i + d/2] sin, x'[i + d/2] = x[i] sin + x[i + d/2] cos [bug: rope-formula]")


def _rope_hint(out, x, positions) -> str:
    d = x.shape[-1]
    half = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # interleaved -> half order
    slow = np.asarray(positions, float)[:, None] * 10000.0 ** (-np.arange(d // 2) / d)  # (L, d/2)
    if _same(out, apply_rope(x, positions, layout="interleaved")[..., half]):
        return ("you rotated the pairs (x[2i], x[2i+1]) (GPT-J's interleaved layout); this notebook pairs "
                "x[i] with x[i + d/2] (Llama's half layout) [bug: interleaved-pairs]")
    if _same(out, apply_rope(x, -np.asarray(positions))):
        return ("your rotation turns the wrong way (by -p f_i): x'[i] = x[i] cos - x[i + d/2] sin "
                "[bug: rotation-direction]")
    if _same(out, apply_rope(x, np.arange(x.shape[-2]))):
        return "you rotated by the row index 0, 1, 2, ..., not by the given positions [bug: positions-ignored]"
    if _same(out, rotate_pairs(x, slow)):
        return "the frequencies are 10000**(-2i/d), with the 2: yours are 10000**(-i/d) [bug: frequency-exponent]"
    return ROPE_HINT


def _check_rope(student, salt, shape, positions):
    x = _rng(50_000 + salt).standard_normal(shape)
    positions = np.asarray(positions)
    expected = apply_rope(x, positions)
    what = f"rope of x {shape} at positions {positions.tolist()}"
    out = checks.call(student, "rope", x, positions)
    checks.expect_array(out, what=what, shape=shape)
    checks.expect_close(out, expected, what=what, hint=_rope_hint(out, x, positions))


def test_rope_values(student):
    _check_rope(student, 1, (3, 2, 5, 6), [17, 3, 40, 41, 0])


def test_rope_values__one_vector_long_head(student):
    _check_rope(student, 2, (1, 64), [1000])


def test_rope_values__no_batch(student):
    _check_rope(student, 3, (7, 10), np.arange(100, 107))


def test_rope_values__positions_as_a_list(student):
    x = _rng(50_004).standard_normal((2, 3, 6))
    positions = [4, 0, 9]  # the task: any sequence of L positions; the visible tests pass lists
    what = f"rope of x {x.shape} at positions given as the Python list {positions}"
    try:
        out = checks.call(student, "rope", x, positions)
    except AssertionError as exc:
        if "` raised " not in str(exc):  # not implemented, not a function: said as it is
            raise
        raise AssertionError(checks.retag(str(exc), "positions-as-list", note=": positions may be any sequence (a "
                                          "list too): np.asarray(positions) before indexing it")) from None
    checks.expect_array(out, what=what, shape=x.shape)
    checks.expect_close(out, apply_rope(x, np.asarray(positions)), what=what, hint=_rope_hint(out, x, positions))


def test_rope_relative(student):
    rng = _rng(50_100)
    q, k = rng.standard_normal((2, 1, 12))

    def score(m, n):
        return float((checks.call(student, "rope", q, np.array([m])) @
                      checks.call(student, "rope", k, np.array([n])).T).item())

    pairs = [(0, 5), (20, 25), (301, 306)]
    scores = [score(m, n) for m, n in pairs]
    checks.expect_true(np.allclose(scores, scores[0], rtol=1e-8, atol=1e-10),
                       what=f"the score of a query at m and a key at n for (m, n) = {pairs}: got {scores}",
                       hint="the score must depend only on n - m: rotate both by their own position with the "
                            "same frequencies [bug: score-not-relative]")
    moved = score(0, 9)
    checks.expect_true(not np.isclose(moved, scores[0]),
                       what=f"the score at distance 5 ({scores[0]:.6g}) and at distance 9 ({moved:.6g}) are equal",
                       hint="the rotation must depend on the position it is given [bug: score-constant]")
    x = rng.standard_normal((4, 12))
    norms = np.linalg.norm(checks.call(student, "rope", x, np.arange(4) * 7), axis=-1)
    checks.expect_true(np.allclose(norms, np.linalg.norm(x, axis=-1), rtol=1e-8),
                       what="rope must keep each vector's length",
                       hint="each pair is rotated, x'[i] = x[i] cos - x[i + d/2] sin, "
                            "x'[i + d/2] = x[i] sin + x[i + d/2] cos [bug: not-a-rotation]")


# --- task 2: paged_decode_step ---------------------------------------------------------------------


@dataclass
class Paged:
    """A paged decoding problem: a RoPE layer, each sequence's tokens, the packed cache, the reference outputs."""

    layer: RotaryAttention
    X_new: np.ndarray  # (B, n_new, d_model)
    state: tuple  # k_pool, v_pool, tables, lengths
    keys: list  # per sequence (h, T + n_new, d_k), rotated
    values: list
    expected: np.ndarray  # (B, n_new, d_model)
    label: str


def _paged_problem(salt: int, cached: list[int], n_new: int, d_model: int, h: int, block_size: int) -> Paged:
    layer = RotaryAttention(d_model, h, seed=int(_rng(90_000 + salt).integers(2**31)))
    rng = _rng(60_000 + salt)
    X = [rng.standard_normal((1, t + n_new, d_model)) for t in cached]
    keys = [layer.rotate(split_heads(Xb @ layer.W_K, h), 0)[0] for Xb in X]  # (h, T + n_new, d_k)
    values = [split_heads(Xb @ layer.W_V, h)[0] for Xb in X]
    capacity = max(cached) + n_new + block_size  # one spare block: a table read one page late still has entries
    state = pack_sequences([k[:, :t] for k, t in zip(keys, cached, strict=True)],
                           [v[:, :t] for v, t in zip(values, cached, strict=True)], block_size, capacity,
                           seed=int(_rng(92_000 + salt).integers(2**31)))
    expected = np.concatenate([layer.forward(Xb, create_causal_mask(Xb.shape[1]))[:, -n_new:] for Xb in X])
    label = (f"B={len(cached)} sequences with {cached} cached, h={h}, d_model={d_model}, block_size={block_size}; "
             "your step is judged with the reference rope in place of yours")
    return Paged(layer, np.concatenate([Xb[:, -n_new:] for Xb in X]), state, keys, values, expected, label)


def _call_paged(student, prob: Paged, x, state, what):
    L = prob.layer
    try:
        result = checks.call_replacing(student, REFERENCE_ROPE, "paged_decode_step", x, *state,
                                       L.W_Q, L.W_K, L.W_V, L.W_O, L.num_heads)
    except AssertionError as exc:
        if "raised IndexError" in str(exc) and _swaps_block_and_row(student):
            raise AssertionError(checks.retag(f"{exc}. {SWAP_HINT}", "block-row-swapped")) from None
        raise
    checks.expect_true(isinstance(result, tuple) and len(result) == 4,
                       what=f"{what}: paged_decode_step should return (out, k_pool, v_pool, lengths), "
                            f"got {type(result).__name__}", hint="return out, k_pool, v_pool, lengths "
                       "[bug: return-out-state]")
    return result


def _step_with(prob: Paged, x, state, *, twice=False, shift=0, rotate_q=True, scaled=True) -> np.ndarray:
    """What one step gives with a known bug: keys rotated again when read, the table read ``shift`` pages late,
    the query left unrotated, the scores not scaled by 1/sqrt(d_k). Shapes: x (B, 1, d_model) -> (B, 1, d_model)."""
    L, (k_pool, v_pool, tables, lengths) = prob.layer, state
    k_pool, v_pool = k_pool.copy(), v_pool.copy()
    h, bs, d_k = L.num_heads, k_pool.shape[2], L.d_k
    out = []
    for b, p in enumerate(lengths):
        q, k, v = (split_heads(x[b:b + 1] @ W, h)[0] for W in (L.W_Q, L.W_K, L.W_V))  # (h, 1, d_k)
        q = (apply_rope(q, [p]) if rotate_q else q) * (1.0 if scaled else np.sqrt(d_k))  # unscaled: q . k alone
        k_pool[tables[b, p // bs], :, p % bs], v_pool[tables[b, p // bs], :, p % bs] = apply_rope(k, [p])[:, 0], v[:, 0]
        table = tables[b, shift:shift + p // bs + 1]
        K, V = (pool[table].transpose(1, 0, 2, 3).reshape(h, -1, d_k)[:, :p + 1] for pool in (k_pool, v_pool))
        K = apply_rope(K, np.arange(p + 1)) if twice else K
        z, _ = scaled_dot_product_attention(q[None], K[None], V[None])  # (1, h, 1, d_k)
        out.append(z.transpose(0, 2, 1, 3).reshape(1, 1, -1) @ L.W_O)
    return np.concatenate(out)


SCALE_HINT = ("scale the scores by 1/sqrt(d_k) before the softmax: softmax(q K^T / sqrt(d_k)) V, d_k = d_model / h "
              "[bug: scale-missing]")
SWAP_HINT = ("block and row are swapped: position p is in block block_tables[b, p // block_size], row p % block_size "
             "(on inputs where your step does not raise, it uses block_tables[b, p % block_size], row p // block_size)"
             " [bug: block-row-swapped]")


def _swapped_slot(k_pool, tables, b: int, p: int) -> tuple | None:
    """Where a step that swaps block and row writes position ``p`` of sequence ``b``: (block, row), or None when
    that slot is the right one or out of range (the swapped step raises there)."""
    bs = k_pool.shape[2]
    if p % bs >= tables.shape[1] or p // bs >= bs or p % bs == p // bs:
        return None
    return tables[b, p % bs], p // bs


def _writes_swapped(prob: Paged, lengths, got_k) -> bool:
    """Whether the keys a step wrote at ``lengths`` (what it was given) sit in ``got_k`` where block and row
    swapped would put them (and not in their own slots)."""
    try:
        slots = [(b, int(p), _swapped_slot(got_k, prob.state[2], b, int(p))) for b, p in enumerate(lengths)]
        return any(slot for _, _, slot in slots) and all(
            slot is None or _same(got_k[slot[0], :, slot[1]], prob.keys[b][:, p]) for b, p, slot in slots)
    except (IndexError, TypeError, ValueError):  # lengths a student returned, past the problem's tokens
        return False


def _swaps_block_and_row(student) -> bool:
    """Whether a step that raised IndexError swaps block and row: on a problem where the swapped step cannot
    index out of range (every position p < block_size**2 and p % block_size inside the table), its new keys sit
    in the swapped slots."""
    prob = _paged_problem(90, [9, 6], 1, d_model=8, h=2, block_size=4)
    L = prob.layer
    try:
        _, got_k, *_ = checks.call_replacing(student, REFERENCE_ROPE, "paged_decode_step", prob.X_new, *prob.state,
                                             L.W_Q, L.W_K, L.W_V, L.W_O, L.num_heads)
        return np.shape(got_k) == prob.state[0].shape and _writes_swapped(prob, prob.state[3], np.asarray(got_k))
    except (AssertionError, ValueError, TypeError):
        return False


def _paged_hint(prob: Paged, x, state, out, got_k) -> str:
    """The likely bug of a step given ``state`` that returned ``out`` and the pool ``got_k``."""
    if np.shape(got_k) == state[0].shape and _writes_swapped(prob, state[3], np.asarray(got_k)):
        return SWAP_HINT
    if _same(out, _step_with(prob, x, state, twice=True)):
        return ("the cache holds keys already rotated at their positions: rotate each key once, when it is "
                "written, and never again when it is read [bug: keys-rotated-twice]")
    if _same(out, _step_with(prob, x, state, shift=1)):
        return ("you read the block table one page late: position j is in block_tables[b, j // block_size], "
                "so positions 0..p are in block_tables[b, :p // block_size + 1] [bug: block-table-off-by-one]")
    if _same(out, _step_with(prob, x, state, rotate_q=False)):
        return "rotate the query too, at the token's position p = lengths[b] [bug: query-not-rotated]"
    if _same(out, _step_with(prob, x, state, scaled=False)):
        return SCALE_HINT
    return ("project x[b] to h heads, rotate q and k at p = lengths[b], write k and v at block_tables[b, p // "
            "block_size], row p % block_size, then attend over positions 0..p read through the table, scaled by "
            "1/sqrt(d_k) [bug: paged-step]")


def _check_cache(student, salt, cached, d_model, h, block_size):
    prob = _paged_problem(salt, cached, 1, d_model, h, block_size)
    k_pool, v_pool, tables, lengths = prob.state
    what = f"paged_decode_step's cache after one step ({prob.label})"
    _, got_k, got_v, got_len = _call_paged(student, prob, prob.X_new, prob.state, what)
    for name, got in (("k_pool", got_k), ("v_pool", got_v)):
        checks.expect_array(got, what=f"{what}: {name}", shape=k_pool.shape)
    checks.expect_true(np.shape(got_len) == lengths.shape and np.array_equal(got_len, lengths + 1),
                       what=f"{what}: lengths {lengths.tolist()} should become {(lengths + 1).tolist()}, got "
                            f"{np.asarray(got_len).tolist()}",
                       hint="advance each sequence's position offset: lengths[b] += 1, so that the next token "
                            "sits one position later [bug: offset-not-advanced]")
    written = np.zeros(k_pool.shape[:1] + k_pool.shape[2:3], bool)  # (N, block_size): the slots of the new tokens
    for b, p in enumerate(lengths):
        block, row = tables[b, p // block_size], p % block_size
        written[block, row] = True
        key = prob.keys[b][:, p]  # (h, d_k), rotated at p
        raw = split_heads(prob.X_new[b:b + 1] @ prob.layer.W_K, h)[0, :, 0]
        hint = ("the cache holds keys rotated at their own position: rotate k at p = lengths[b] before writing it"
                " [bug: key-not-rotated]" if _same(got_k[block, :, row], raw) else SWAP_HINT
                if _writes_swapped(prob, lengths, got_k) else
                "write the new key at block_tables[b, p // block_size], row p % block_size, with p = lengths[b], "
                "rotated at p [bug: key-slot]")
        checks.expect_close(got_k[block, :, row], key, what=f"{what}: sequence {b}'s new key (position {p})",
                            hint=hint)
        checks.expect_close(got_v[block, :, row], prob.values[b][:, p],
                            what=f"{what}: sequence {b}'s new value (position {p})",
                            hint="write v = x[b] @ W_V (h heads, not rotated) next to the key [bug: value-slot]")
    keep = ~written[:, None, :, None]  # (N, 1, block_size, 1)
    checks.expect_true(bool(np.all((got_k == k_pool) | ~keep) and np.all((got_v == v_pool) | ~keep)),
                       what=f"{what}: slots other than the new tokens' changed",
                       hint="write only the new token's slot of each sequence [bug: pool-overwritten]")


def test_paged_decode_cache(student):
    _check_cache(student, 1, [6, 0, 11, 3], d_model=12, h=3, block_size=3)


def test_paged_decode_cache__one_sequence(student):
    _check_cache(student, 2, [16], d_model=8, h=2, block_size=8)


def _check_values(student, salt, cached, d_model, h, block_size):
    prob = _paged_problem(salt, cached, 1, d_model, h, block_size)
    what = f"paged_decode_step's output ({prob.label}) vs the causal forward with RoPE"
    out, got_k, *_ = _call_paged(student, prob, prob.X_new, prob.state, what)
    checks.expect_array(out, what=what, shape=prob.expected.shape)
    checks.expect_close(out, prob.expected, what=what, hint=_paged_hint(prob, prob.X_new, prob.state, out, got_k))


def test_paged_decode_values(student):
    _check_values(student, 3, [7, 1, 12], d_model=12, h=2, block_size=4)


def test_paged_decode_values__first_token(student):
    _check_values(student, 4, [0, 5], d_model=8, h=4, block_size=2)


def test_paged_decode_values__block_of_one(student):
    _check_values(student, 5, [3, 9], d_model=6, h=3, block_size=1)


def _check_sequence(student, salt, cached, n_new, d_model, h, block_size):
    prob = _paged_problem(salt, cached, n_new, d_model, h, block_size)
    what = f"decoding {n_new} tokens in a row ({prob.label})"
    states, outs, pools = [prob.state], [], []  # what each step was given, returned, wrote
    for t in range(n_new):
        out, k_pool, v_pool, lengths = _call_paged(student, prob, prob.X_new[:, t:t + 1], states[t], what)
        checks.expect_array(out, what=f"{what}: output of step {t}", shape=(len(cached), 1, d_model))
        states, outs, pools = states + [(k_pool, v_pool, prob.state[2], lengths)], outs + [out], pools + [k_pool]
    checks.expect_close(np.concatenate(outs, axis=1), prob.expected, what=f"{what} vs the causal forward",
                        hint=_sequence_hint(prob, states, outs, pools))


def _sequence_hint(prob: Paged, states, outs, pools) -> str:
    """The first wrong step's bug when that step is wrong on the state it was given, else the state handed on."""
    wrong = [t for t, out in enumerate(outs) if not _same(out, prob.expected[:, t:t + 1])]
    t = wrong[0] if wrong else 0
    x = prob.X_new[:, t:t + 1]
    try:
        own_fault = not _same(outs[t], _step_with(prob, x, states[t]))
    except (IndexError, TypeError, ValueError):  # the state a student's step returned cannot be stepped on
        own_fault = False
    return _paged_hint(prob, x, states[t], outs[t], pools[t]) if own_fault else (
        "each step receives the pools and lengths the previous step returned: write every new key and value, "
        "advance lengths, and read positions 0..p through the table [bug: sequence-state]")


def test_paged_decode_sequence(student):
    _check_sequence(student, 6, [2, 9, 4], 5, d_model=12, h=3, block_size=4)


def test_paged_decode_sequence__from_empty(student):
    _check_sequence(student, 7, [0, 0], 7, d_model=8, h=2, block_size=3)


# --- task 3: merge_partials ------------------------------------------------------------------------

OVERFLOW_HINT = ("exp of a score in the thousands overflows: rescale each chunk by exp(m[c] - M), with M the "
                 "largest m over the chunks of the same row [bug: exp-overflow]")


def _merge_problem(salt, shape, T, splits, scale=1.0):
    rng = _rng(70_000 + salt)
    q = scale * rng.standard_normal(shape[:-2] + (1, shape[-1]))
    K, V = rng.standard_normal(shape[:-2] + (T, shape[-1])), rng.standard_normal(shape[:-2] + (T, shape[-1]))
    return split_k_partials(q, K, V, splits), scaled_dot_product_attention(q, K, V)[0]


def _merge_hint(out, m, l, acc) -> str:
    if _same(out, acc.sum(axis=0) / l.sum(axis=0)):
        return ("each chunk's l and acc are relative to its own maximum m[c]: multiply them by exp(m[c] - M) "
                "before adding them up [bug: merged-without-max]")
    if _same(out, (acc / l).mean(axis=0)):
        return ("averaging the chunks' outputs weights every chunk equally: weight chunk c by exp(m[c] - M) l[c] "
                "[bug: average-of-chunks]")
    return "out = sum_c exp(m[c] - M) acc[c] / sum_c exp(m[c] - M) l[c], M = max_c m[c] [bug: merge-formula]"


def _check_merge(student, salt, shape, T, splits, scale=1.0):
    (m, l, acc), expected = _merge_problem(salt, shape, T, splits, scale)
    what = f"merge_partials of {splits} chunks of {T} keys, (B, h, 1, d) = {expected.shape}" + (
        f", queries scaled by {scale:g}" if scale != 1 else "")
    out = checks.call(student, "merge_partials", m, l, acc)
    checks.expect_array(out, what=what, shape=expected.shape, hint=OVERFLOW_HINT)
    checks.expect_close(out, expected, what=f"{what} vs the softmax over all keys", hint=_merge_hint(out, m, l, acc))


def test_merge_values(student):
    _check_merge(student, 1, (3, 2, 1, 5), T=23, splits=5)


def test_merge_values__one_chunk(student):
    _check_merge(student, 2, (1, 4, 1, 6), T=9, splits=1)


def test_merge_values__peaked_chunks(student):
    _check_merge(student, 3, (2, 1, 1, 4), T=64, splits=8, scale=20.0)


def test_merge_large(student):
    _check_merge(student, 4, (2, 3, 1, 8), T=48, splits=6, scale=2000.0)
