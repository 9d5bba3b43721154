"""Hidden checks of ps3_memory_efficient: measure_peak, head_by_head_forward, chunked_attention.

Every check has three steps: make the inputs (shapes the visible tests do not use, random numbers drawn
anew for every grading run, so that no output shown in feedback can be replayed), call the student's
function through ``checks.call``, judge the result. Memory is graded on its
own cells, on the shapes and budgets the visible memory tests use, and only for the computation
asked for: the measured call's output must match the reference at that size (a wrong result earns
no memory points). The peak counts what the student's code holds from its first cell on (a buffer
kept between calls, a file of the folder) and what the call allocates (``remote.RemoteSubmission
.remote_call``); where the host measures no memory the memory cells earn nothing and say so.
Arrays of the inputs' size are allowed; only an L x L matrix breaks a budget.
"""

import numpy as np

from mha_lab.cpu import MultiHeadAttention, create_causal_mask, scaled_dot_product_attention
from mha_lab.grading import checks

# the package's own code for each task (the book prints it): what the class report's similarity compares answers with
PACKAGE_ANSWERS = {"measure_peak": ["mha_lab.measure.traced_memory"],
                   "head_by_head_forward": ["mha_lab.cpu.head_by_head_forward"],
                   "chunked_attention": ["mha_lab.cpu.chunked_attention"]}

MiB = 2**20
_rng = checks.fresh_inputs()  # new inputs in every grading run


def _expect_computed(out, expected: np.ndarray, what: str) -> None:
    """Memory points only for the computation asked for: the measured call's output matches the reference at
    that size, within a tolerance that allows summing in another order but not skipped work."""
    got = out.shape if isinstance(out, np.ndarray) else type(out).__name__
    checks.expect_true(isinstance(out, np.ndarray) and out.shape == expected.shape,
                       what=f"{what}: expected an array of shape {expected.shape}, got {got}",
                       hint="return the output array [bug: return-output]")
    ok = np.isfinite(out).all() and np.allclose(out, expected, rtol=1e-6, atol=1e-9)
    checks.expect_true(ok, what=f"{what}: the output of the measured call is wrong (max abs error "
                       f"{float(np.nanmax(np.abs(out - expected))) if out.size else 0:.3g}), and a wrong result "
                       "earns no memory points", hint="memory is judged for the computation asked for: make the "
                       "values right (the values cells name the bug), then the memory counts "
                       "[bug: measured-output-wrong]")


# --- measure_peak --------------------------------------------------------------------------------


def _judge_measured(result, expected, held: int, what: str) -> None:
    """Step 3 for measure_peak: a pair, fn's result, and a peak of at least the ``held`` bytes ``what`` holds at
    its peak, and at most 1 MiB more."""
    checks.expect_true(isinstance(result, tuple) and len(result) == 2,
                       what="measure_peak should return a pair (result, peak_bytes)",
                       hint="return fn's result and the peak, e.g. `return result, peak` [bug: return-result-peak]")
    value, peak = result
    same = np.shape(value) == np.shape(expected) and bool(np.allclose(value, expected))
    checks.expect_true(same, what=f"measure_peak returned a {type(value).__name__} of shape {np.shape(value)} as "
                            f"the result of {what}, not what fn returned",
                       hint="call fn(*args, **kwargs) exactly once and return what it returns [bug: call-fn-once]")
    checks.expect_true(isinstance(peak, (int, np.integer)),
                       what=f"peak_bytes should be an int (bytes), got {type(peak).__name__}",
                       hint="tracemalloc.get_traced_memory() returns ints: (current, peak) [bug: peak-not-int]")
    checks.expect_true(held <= peak <= held + MiB,
                       what=f"measure_peak reported {peak} bytes for {what}, which holds {held} bytes at its peak",
                       hint="take the PEAK (second value of tracemalloc.get_traced_memory()), not the current "
                            "size, after fn returns; start tracing (or reset_peak) before calling fn"
                            " [bug: current-not-peak]")


def test_measure_peak_values(student):
    # 1. inputs of fresh sizes: np.std of n float64 numbers holds one temporary (x - mean) of x's size at its
    #    peak; np.multiply of an (n, 1) column and a (1, m) row makes an (n, m) product from n + m numbers, a
    #    peak that the arguments' sizes do not give
    rng = _rng(0)
    x = rng.standard_normal(int(rng.integers(600_000, 1_200_000)))
    column, row = rng.standard_normal((int(rng.integers(300, 500)), 1)), rng.standard_normal((1, 400))
    # 2. call
    spread = checks.call(student, "measure_peak", np.std, x)
    product = checks.call(student, "measure_peak", np.multiply, column, row)
    # 3. judge
    _judge_measured(spread, np.std(x), x.nbytes, f"np.std of {x.size} float64 numbers")
    _judge_measured(product, column * row, column.size * row.size * 8,
                    f"np.multiply of a ({column.size}, 1) column and a (1, {row.size}) row")


# --- head_by_head_forward ------------------------------------------------------------------------


def _layer_inputs(seed: int, B: int, L: int, d_model: int, h: int):
    """A fused layer of fresh weights and an input batch (``_rng(seed)``); the layer is the reference."""
    rng = _rng(seed)
    layer = MultiHeadAttention(d_model, h, seed=int(rng.integers(2**31)))
    X = rng.standard_normal((B, L, d_model))
    return layer, X


def _weights(layer):
    return layer.W_Q, layer.W_K, layer.W_V, layer.W_O


def _wrong_scale_reference(layer, X, mask4=None) -> np.ndarray:
    """The layer's output had the scores been divided by sqrt(d_model) instead of sqrt(d_k)."""
    wrong = MultiHeadAttention(layer.d_model, layer.num_heads, seed=0)
    wrong.W_Q = layer.W_Q * np.sqrt(layer.d_k / layer.d_model)
    wrong.W_K, wrong.W_V, wrong.W_O = layer.W_K, layer.W_V, layer.W_O
    return wrong.forward(X, mask4)


def _hbh_hint(out, layer, X, mask4=None) -> str:
    if out.shape == X.shape and np.allclose(out, _wrong_scale_reference(layer, X, mask4), rtol=1e-8, atol=1e-10):
        return ("the scores are scaled by sqrt(d_model); divide by sqrt(d_k), the head size d_model // num_heads"
                " [bug: scale-d-model]")
    return ("head i uses COLUMNS i*d_k:(i+1)*d_k of W_Q, W_K, W_V and ROWS i*d_k:(i+1)*d_k of W_O; "
            "scale by 1/sqrt(d_k); sum the heads' contributions to the output [bug: head-slices]")


def _check_hbh_values(student, seed, B, L, d_model, h):
    # 1. inputs
    layer, X = _layer_inputs(seed, B, L, d_model, h)
    expected = layer.forward(X)
    # 2. call
    out = checks.call(student, "head_by_head_forward", X, *_weights(layer), h)
    # 3. judge
    what = f"head_by_head_forward (B={B}, L={L}, d_model={d_model}, num_heads={h})"
    checks.expect_array(out, what=what, shape=X.shape)
    checks.expect_close(out, expected, what=what, hint=_hbh_hint(out, layer, X))


def test_head_by_head_forward_shape(student):
    # 1. inputs
    layer, X = _layer_inputs(1, B=3, L=7, d_model=12, h=3)
    # 2. call
    out = checks.call(student, "head_by_head_forward", X, *_weights(layer), 3)
    # 3. judge
    checks.expect_array(out, what="head_by_head_forward output (B=3, L=7, d_model=12, num_heads=3)", shape=(3, 7, 12))


def test_head_by_head_forward_values__several_heads(student):
    _check_hbh_values(student, seed=2, B=2, L=9, d_model=12, h=4)


def test_head_by_head_forward_values__one_head(student):
    _check_hbh_values(student, seed=3, B=1, L=5, d_model=6, h=1)


def test_head_by_head_forward_values__one_token(student):
    _check_hbh_values(student, seed=4, B=3, L=1, d_model=8, h=2)


def _check_hbh_mask(student, seed, mask):
    # 1. inputs
    B, d_model, h = 2, 12, 3
    L = mask.shape[-1]
    layer, X = _layer_inputs(seed, B, L, d_model, h)
    expected = layer.forward(X, mask[None, None])  # (L, L) -> (1, 1, L, L)
    # 2. call
    out = checks.call(student, "head_by_head_forward", X, *_weights(layer), h, mask=mask)
    # 3. judge
    what = f"head_by_head_forward with an (L, L) mask (L={L})"
    checks.expect_array(out, what=what, shape=X.shape)
    if np.allclose(out, layer.forward(X), rtol=1e-8, atol=1e-10):
        raise AssertionError(f"{what}: the output ignores the mask. Likely bug: add the mask to every head's "
                             "scores before the softmax")
    checks.expect_close(out, expected, what=what,
                        hint="add the additive (L, L) mask to the scaled scores of every head, before the softmax; "
                             + _hbh_hint(out, layer, X, mask[None, None]))


def test_head_by_head_forward_mask__causal(student):
    _check_hbh_mask(student, 5, create_causal_mask(9)[0, 0])  # (1, 1, L, L) -> (L, L)


def test_head_by_head_forward_mask__padding(student):
    mask = np.zeros((6, 6))
    mask[:, 4:] = -np.inf  # the last two keys are padding: nobody attends to them
    _check_hbh_mask(student, 6, mask)


def _hot_layer(B: int, L: int, d_model: int, h: int):
    """A layer whose scores are in the thousands, far beyond exp's float64 range (exp(710) overflows), drawn
    until every row's largest score beats the next by more than 40 sqrt(d_model): then each softmax row is
    exactly one-hot at either scale, so this check judges overflow, not the scale (the values cells do)."""
    for attempt in range(1000):
        layer, X = _layer_inputs(8 + 1000 * attempt, B, L, d_model, h)
        layer.W_Q = 1000.0 * layer.W_Q
        d_k = d_model // h
        Q, K = ((X @ W).reshape(B, L, h, d_k).transpose(0, 2, 1, 3) for W in (layer.W_Q, layer.W_K))  # (B, h, L, d_k)
        top2 = np.sort(Q @ K.transpose(0, 1, 3, 2), axis=-1)[..., -2:]  # (B, h, L, 2)
        if (top2[..., 1] - top2[..., 0]).min() > 40 * np.sqrt(d_model):
            return layer, X
    raise RuntimeError("no layer with one-hot softmax rows was drawn")


def test_head_by_head_forward_stability(student):
    # 1. inputs: scores in the thousands, each softmax row one-hot
    layer, X = _hot_layer(B=2, L=6, d_model=12, h=3)
    expected = layer.forward(X)
    # 2. call
    out = checks.call(student, "head_by_head_forward", X, *_weights(layer), 3)
    # 3. judge
    what = "head_by_head_forward with scores in the thousands"
    hint = "exp overflowed: subtract each row's maximum from the scores before exp [bug: softmax-overflow]"
    checks.expect_array(out, what=what, shape=X.shape, hint=hint)
    checks.expect_close(out, expected, what=what, hint=_hbh_hint(out, layer, X))


def test_head_by_head_forward_memory(student):
    # 1. inputs: 16 heads, so a full (B, h, L, L) score tensor is sixteen of one head's (B, L, L) matrices
    B, L, d_model, h = 1, 256, 64, 16
    layer, X = _layer_inputs(7, B, L, d_model, h)
    budget = B * h * L * L * 8 // 2  # as in the notebook's visible test
    # 2. call
    out, peak = checks.call_with_peak(student, "head_by_head_forward", X, *_weights(layer), h)
    # 3. judge: the values at this size, then the peak
    what = f"head_by_head_forward memory (B={B}, L={L}, num_heads={h})"
    _expect_computed(out, layer.forward(X), what)
    checks.expect_within_budget(
        peak, budget, what=what + " (half of one full (B, h, L, L) score tensor)",
        hint="more than one head's (B, L, L) scores are alive at once: a full (B, h, L, L) score tensor, or a list "
             "that keeps every head's weights; compute one head, add its contribution, let its matrix go"
             " [bug: all-heads-alive]")


# --- chunked_attention ---------------------------------------------------------------------------


def _qkv(seed: int, B: int, h: int, L: int, d: int, scale: float = 1.0):
    rng = _rng(seed)
    Q = scale * rng.standard_normal((B, h, L, d))
    K, V = rng.standard_normal((B, h, L, d)), rng.standard_normal((B, h, L, d))
    return Q, K, V


def _attention(Q, K, V, causal=False) -> np.ndarray:
    return scaled_dot_product_attention(Q, K, V, create_causal_mask(Q.shape[2]) if causal else None)[0]


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-8, atol=1e-10))


def _student_right(student, Q, K, V, block, causal) -> bool:
    """Whether the student's chunked_attention gets this smaller probe right (used to name a bug)."""
    try:
        out = checks.call(student, "chunked_attention", Q, K, V, block, causal=causal)
    except AssertionError:
        return False
    return isinstance(out, np.ndarray) and _close(out, _attention(Q, K, V, causal))


def _online(Q, K, V, block, causal, *, rescale_acc=True, carry_max=True) -> np.ndarray:
    """The online softmax tile by tile, with one of its two slips when asked: the accumulator not rescaled by
    exp(m_old - m_new), or the running max not carried to the next key block (it stays -inf)."""
    L, d = Q.shape[2], Q.shape[3]
    out = np.empty(Q.shape[:3] + V.shape[-1:])
    for qs in range(0, L, block):
        q = Q[:, :, qs:qs + block] / np.sqrt(d)  # (B, h, bq, d)
        m = np.full(q.shape[:3] + (1,), -np.inf)
        l, acc = np.zeros_like(m), np.zeros(q.shape[:3] + V.shape[-1:])
        for ks in range(0, min(qs + block, L) if causal else L, block):
            S = q @ K[:, :, ks:ks + block].transpose(0, 1, 3, 2)  # (B, h, bq, bk)
            if causal:
                S = np.where(np.arange(ks, ks + S.shape[-1]) > np.arange(qs, qs + S.shape[-2])[:, None], -np.inf, S)
            m_new = np.maximum(m, S.max(axis=-1, keepdims=True))
            P, alpha = np.exp(S - m_new), np.exp(m - m_new)
            l = alpha * l + P.sum(axis=-1, keepdims=True)
            acc = (alpha * acc if rescale_acc else acc) + P @ V[:, :, ks:ks + block]
            m = m_new if carry_max else m
        out[:, :, qs:qs + block] = acc / l
    return out


def _chunked_hint(student, out, Q, K, V, block, causal=False) -> str | None:
    """Name the likely bug by probing the student's function on simpler cases; None when no probe tells."""
    L = Q.shape[2]
    if causal and np.isfinite(out).all() and _close(out, _attention(Q, K, V)):
        return ("causal=True is ignored: mask the keys j > i and skip the key blocks above the diagonal"
                " [bug: causal-ignored]")
    if L % block:
        full = (L // block) * block  # drop the partial block: is everything else right?
        probe = (Q[:, :, :full], K[:, :, :full], V[:, :, :full], block) if full else (Q, K, V, L)
        if _student_right(student, *probe, causal):
            return ("the last, partial block is skipped or cut wrong: loop over ceil(L / block_size) blocks and end "
                    "each block at min(start + block_size, L) [bug: partial-block]")
    if block < L and _student_right(student, Q, K, V, L, causal):
        slip = next((bug for bug, kw in (("acc-not-rescaled", {"rescale_acc": False}),
                                         ("max-not-carried", {"carry_max": False}))
                     if np.isfinite(out).all() and _close(out, _online(Q, K, V, block, causal, **kw))), "no-rescale")
        return ("right with one block, wrong across several: when the running maximum grows, rescale the "
                "accumulator and the normaliser by exp(m_old - m_new), and carry the running max m forward"
                f" [bug: {slip}]")
    d = Q.shape[-1]
    if np.isfinite(out).all() and _close(out, _attention(Q / np.sqrt(d), K, V, causal)):
        return "the scores are divided by d instead of sqrt(d) [bug: scale-d-not-sqrt]"
    return None


GENERIC_HINT = ("check the scale 1/sqrt(d) with d = Q.shape[-1], the online-softmax update (m_new = max(m, rowmax(S)); "
                "l = exp(m - m_new) l + rowsum(P); acc = exp(m - m_new) acc + P V), and the final division acc / l"
                " [bug: online-softmax]")
RUNNING_MAX_HINT = ("a row whose scores are all below about -745 gives exp(S - m) = 0 when the running maximum "
                    "starts at 0, and then 0 / 0: start m at -inf (np.full(..., -np.inf)), not at 0"
                    " [bug: running-max-at-zero]")
DIAGONAL_HINT = ("the causal mask of the diagonal block also hides the diagonal, so a query sees no key at all: mask "
                 "key j for query i only when j > i (global positions qs + r and ks + c) [bug: diagonal-masked]")
OVERFLOW_HINT = ("exp overflowed: subtract the running maximum before exp (P = exp(S - m_new)), and rescale with "
                 "exp(m_old - m_new) [bug: exp-overflow]")


def _judge_chunked(student, out, Q, K, V, block, *, causal, what, nonfinite_hint) -> None:
    """Step 3 for chunked_attention: type, shape, dtype, finiteness, values; a failure names the likely bug."""
    expected = _attention(Q, K, V, causal)
    try:
        checks.expect_array(out, what=what, shape=expected.shape)
        checks.expect_close(out, expected, what=what, hint=GENERIC_HINT)
    except AssertionError:
        if type(out) is not np.ndarray or out.shape != expected.shape:
            raise
        finite = bool(np.isfinite(out).all())
        hint = _chunked_hint(student, out, Q, K, V, block, causal) or (GENERIC_HINT if finite else nonfinite_hint)
        checks.expect_array(out, what=what, shape=expected.shape, hint=hint)
        checks.expect_close(out, expected, what=what, hint=hint)


def _check_chunked(student, seed, B, h, L, d, block, causal=False):
    # 1. inputs
    Q, K, V = _qkv(seed, B, h, L, d)
    # 2. call
    out = checks.call(student, "chunked_attention", Q, K, V, block, causal=causal)
    # 3. judge
    what = f"chunked_attention (B={B}, h={h}, L={L}, d={d}, block_size={block}, causal={causal})"
    _judge_chunked(student, out, Q, K, V, block, causal=causal, what=what,
                   nonfinite_hint=DIAGONAL_HINT if causal else OVERFLOW_HINT)


def test_chunked_attention_shape(student):
    # 1. inputs
    Q, K, V = _qkv(11, B=3, h=2, L=11, d=7)
    # 2. call
    out = checks.call(student, "chunked_attention", Q, K, V, 4)
    # 3. judge
    checks.expect_array(out, what="chunked_attention output (B=3, h=2, L=11, d=7, block_size=4)", shape=(3, 2, 11, 7))


def test_chunked_attention_values__one_block(student):
    _check_chunked(student, 12, B=2, h=3, L=10, d=6, block=16)


def test_chunked_attention_values__several_blocks(student):
    _check_chunked(student, 13, B=2, h=2, L=24, d=5, block=8)


def test_chunked_attention_values__partial_block(student):
    _check_chunked(student, 14, B=1, h=3, L=29, d=4, block=8)


def test_chunked_attention_values__one_token(student):
    _check_chunked(student, 15, B=2, h=2, L=1, d=3, block=4)


def test_chunked_attention_causal__partial_block(student):
    _check_chunked(student, 16, B=2, h=2, L=29, d=5, block=8, causal=True)


def test_chunked_attention_causal__block_of_one(student):
    _check_chunked(student, 17, B=1, h=3, L=7, d=4, block=1, causal=True)


def test_chunked_attention_causal__one_token(student):
    _check_chunked(student, 18, B=1, h=1, L=1, d=4, block=2, causal=True)


def test_chunked_attention_stability(student):
    # 1. inputs: scores of about +-1000, far beyond exp's float64 range (exp(710) overflows)
    Q, K, V = _qkv(19, B=1, h=2, L=48, d=8, scale=1000.0)
    # 2. call
    out = checks.call(student, "chunked_attention", Q, K, V, 16)
    # 3. judge
    _judge_chunked(student, out, Q, K, V, 16, causal=False, what="chunked_attention with large scores (|S| ~ 1000)",
                   nonfinite_hint=OVERFLOW_HINT)


def test_chunked_attention_stability__very_negative_rows(student):
    # 1. inputs: keys with positive entries; half the queries strongly negative, so every score of those
    #    rows is below -745, where exp underflows to 0. The softmax of such a row is still well defined.
    B, h, L, d, block = 1, 2, 48, 8, 16
    rng = _rng(21)
    K = np.abs(rng.standard_normal((B, h, L, d))) + 0.5
    Q, V = rng.standard_normal((B, h, L, d)), rng.standard_normal((B, h, L, d))
    Q[:, :, ::2] = -1200.0 * (np.abs(Q[:, :, ::2]) + 0.5)  # scores <= -1200 * 0.25 * d / sqrt(d) < -745
    # 2. call
    out = checks.call(student, "chunked_attention", Q, K, V, block)
    # 3. judge
    _judge_chunked(student, out, Q, K, V, block, causal=False,
                   what="chunked_attention with rows whose scores are all below -745", nonfinite_hint=RUNNING_MAX_HINT)


def test_chunked_attention_memory(student):
    # 1. inputs: a full (B, h, L, L) float64 score tensor would take 32 MiB; Q alone takes 0.5 MiB
    B, h, L, d, block = 1, 4, 1024, 16, 64
    Q, K, V = _qkv(20, B, h, L, d)
    full_scores = B * h * L * L * 8
    budget = full_scores // 8  # as in the notebook's visible test: room for several arrays the size of Q
    # 2. call
    out, peak = checks.call_with_peak(student, "chunked_attention", Q, K, V, block)
    # 3. judge: the values at this size, then the peak
    what = f"chunked_attention memory (B={B}, h={h}, L={L}, d={d}, block_size={block})"
    _expect_computed(out, _attention(Q, K, V), what)
    checks.expect_within_budget(
        peak, budget, what=f"{what} (1/8 of a full {full_scores // MiB} MiB score tensor)",
        hint="an L x L (or L x block_size) score matrix is built: work in tiles of block_size queries x "
             "block_size keys, so the largest temporary is (B, h, block_size, block_size) [bug: full-score-matrix]")
