"""Hidden checks of ps1_per_head_loop: split/merge heads, single-head attention, the per-head loop.

Each check: (1) make seeded inputs on shapes the notebook's visible tests do not use,
(2) call the student's function, (3) judge it against mha_lab's reference.
The loop is judged with mha_lab's attention in place of the student's ``attention``, so a bug
in task 2 is not charged again in task 3.

Bugs the checks name, and the tasks they can occur in: the scale of the scores in every function that computes
them (attention: 1/d_k or none, named by its mask checks too; the loop: its queries rescaled so that the scores
come out divided by sqrt(d_model), "as the paper does"); the mask's sign wherever a mask is applied.
"""

import copy

import numpy as np

from mha_lab.cpu import MultiHeadAttention, create_causal_mask, merge_heads, scaled_dot_product_attention, split_heads
from mha_lab.grading import checks
from mha_lab.grading.references import Array, Reference

# the package's own code for each task (the book prints it): what the class report's similarity compares answers with
PACKAGE_ANSWERS = {"split_heads": ["mha_lab.cpu.split_heads"], "merge_heads": ["mha_lab.cpu.merge_heads"],
                   "attention": ["mha_lab.cpu.scaled_dot_product_attention", "mha_lab.cpu.softmax"],
                   "mha_forward_loop": ["mha_lab.cpu.per_head.per_head_attention", "mha_lab.cpu.per_head.head_forward",
                                        "mha_lab.cpu.per_head.head_slices"]}
REFERENCE_ATTENTION = {"attention": Reference("mha_lab.cpu.scaled_dot_product_attention", (
    ("Q", Array((2, 4))), ("K", Array((2, 4))), ("V", Array((2, 4))), ("mask", Array((2, 4), optional=True))), 3)}
SPLIT_HINT = ("(B, L, d_model) -> (B, L, h, d_k) -> (B, h, L, d_k): reshape first, then transpose. "
              "Did you reshape without transposing, or transpose before reshaping? [bug: split-layout]")
MERGE_HINT = ("(B, h, L, d_k) -> (B, L, h, d_k) -> (B, L, d_model): transpose first, then reshape. "
              "Did you reshape without transposing? [bug: merge-layout]")
SCALE_HINT = ("scale the scores by 1/sqrt(d_k), with d_k = Q.shape[-1] (not 1/d_k, not 1/sqrt(d_model))"
              " [bug: scale-not-sqrt-d-k]")
MASK_HINT = ("the additive mask is 0 where attention is allowed and -inf where it is not: add it to the "
             "scores before the softmax. Is the mask inverted? [bug: mask-inverted]")
LOOP_SCALE_HINT = ("the scores come out divided by sqrt(d_model): attention already divides them by sqrt(d_k), the "
                   "head size, so head i's query is X @ W_Q[:, i*d_k:(i+1)*d_k], not rescaled [bug: scale-d-model]")
STABILITY_HINT = "softmax without subtracting the row maximum overflows: exp(1000) is inf [bug: softmax-overflow]"


_fresh = checks.fresh_inputs()  # new inputs in every grading run


def _rng(salt: int) -> np.random.Generator:
    return _fresh(20_240 + salt)


# --- task 1: split_heads / merge_heads ----------------------------------------------------------


def test_split_heads_shape(student):
    x = _rng(1).normal(size=(3, 5, 12))  # B=3, L=5, d_model=12

    out = checks.call(student, "split_heads", x, 4)

    checks.expect_array(out, what="split_heads(x of shape (3, 5, 12), 4)", shape=(3, 4, 5, 3))


def test_split_heads_values(student):
    x = _rng(2).normal(size=(3, 5, 12))
    expected = split_heads(x, 3)

    out = checks.call(student, "split_heads", x, 3)

    checks.expect_array(out, what="split_heads(x, 3)", shape=expected.shape)
    checks.expect_close(out, expected, what="split_heads(x, 3): head i must hold features i*d_k:(i+1)*d_k",
                        hint=_split_hint(out, x, 3))


def _split_hint(out, x, h: int) -> str:
    """SPLIT_HINT, its id naming the wrong order ``out`` shows when it is one of the two (the words stay)."""
    B, L, d = x.shape
    for bug, wrong in (("split-no-transpose", x.reshape(B, h, L, d // h)),
                       ("split-transpose-first", x.transpose(0, 2, 1).reshape(B, h, L, d // h))):
        if np.shape(out) == wrong.shape and np.allclose(out, wrong):
            return checks.retag(SPLIT_HINT, bug)
    return SPLIT_HINT


def test_merge_heads_values(student):
    y = _rng(3).normal(size=(2, 3, 7, 5))  # B=2, h=3, L=7, d_k=5
    expected = merge_heads(y)

    out = checks.call(student, "merge_heads", y)

    checks.expect_array(out, what="merge_heads(y of shape (2, 3, 7, 5))", shape=(2, 7, 15))
    checks.expect_close(out, expected, what="merge_heads: token t must hold head 0's features, then head 1's...",
                        hint=MERGE_HINT)


def test_merge_heads_values__round_trip(student):
    x = _rng(4).normal(size=(4, 6, 8))
    heads = split_heads(x, 2)

    out = checks.call(student, "merge_heads", heads)

    checks.expect_array(out, what="merge_heads(split_heads(x, 2))", shape=x.shape)
    checks.expect_close(out, x, what="merge_heads(split_heads(x)) must give x back", hint=MERGE_HINT)


# --- task 2: attention --------------------------------------------------------------------------


def _qkv(salt: int, B: int = 3, L_q: int = 5, L_k: int = 7, d_k: int = 6, d_v: int = 4, scale: float = 1.0):
    rng = _rng(salt)
    return (scale * rng.normal(size=(B, L_q, d_k)), scale * rng.normal(size=(B, L_k, d_k)),
            rng.normal(size=(B, L_k, d_v)))


def _scale_hint(weights, Q, K, V, mask, other: str) -> str:
    """SCALE_HINT when ``weights`` are those of scores scaled by 1/d_k or not at all, else ``other`` (a mask
    check's hint: a wrong scale fails it too, and the mask is not to blame)."""
    d_k = Q.shape[-1]
    for q_scale in (1 / np.sqrt(d_k), np.sqrt(d_k)):  # scores / d_k, scores unscaled
        wrong = scaled_dot_product_attention(Q * q_scale, K, V, mask)[1]
        if np.shape(weights) == wrong.shape and np.allclose(weights, wrong, rtol=1e-8, atol=1e-10):
            return SCALE_HINT
    return other


def _judge_attention(result, Q, K, V, mask, what: str, hint: str) -> None:
    expected_out, expected_w = scaled_dot_product_attention(Q, K, V, mask)
    checks.expect_true(isinstance(result, tuple) and len(result) == 2,
                       what=f"{what}: expected a tuple (output, weights), got {type(result).__name__}",
                       hint="return output, weights [bug: return-output-weights]")
    out, weights = result
    hint = _scale_hint(weights, Q, K, V, mask, hint)
    checks.expect_array(weights, what=f"{what}: weights", shape=expected_w.shape, hint=hint)
    checks.expect_array(out, what=f"{what}: output", shape=expected_out.shape, hint=hint)
    checks.expect_close(weights, expected_w, what=f"{what}: weights", hint=hint)
    checks.expect_close(out, expected_out, what=f"{what}: output", hint=hint)


def test_attention_values(student):
    Q, K, V = _qkv(5)  # L_q != L_k, d_k != d_v

    result = checks.call(student, "attention", Q, K, V)

    _judge_attention(result, Q, K, V, None, "attention(Q, K, V) without a mask", SCALE_HINT)


def test_attention_mask(student):
    Q, K, V = _qkv(6, L_q=6, L_k=6)
    causal = create_causal_mask(6)[0, 0]  # (L, L)

    result = checks.call(student, "attention", Q, K, V, causal)

    _judge_attention(result, Q, K, V, causal, "attention with a causal mask", MASK_HINT)


def test_attention_mask__padding(student):
    Q, K, V = _qkv(7, B=2, L_q=4, L_k=6)
    padding = np.zeros((2, 1, 6))
    padding[1, :, 4:] = -np.inf  # the second sequence has two padding tokens at the end

    result = checks.call(student, "attention", Q, K, V, padding)

    _judge_attention(result, Q, K, V, padding, "attention with a padding mask of shape (B, 1, L_k)", MASK_HINT)


def test_attention_stability(student):
    Q, K, V = _qkv(8, scale=40.0)  # scores in the thousands

    result = checks.call(student, "attention", Q, K, V)

    checks.expect_true(isinstance(result, tuple) and len(result) == 2,
                       what="attention must return (output, weights)", hint="return output, weights"
                                                                            " [bug: return-output-weights]")
    out, weights = result
    checks.expect_array(weights, what="attention weights for scores in the thousands", shape=(3, 5, 7),
                        hint=STABILITY_HINT)
    checks.expect_array(out, what="attention output for scores in the thousands", shape=(3, 5, 4),
                        hint=STABILITY_HINT)
    checks.expect_close(weights.sum(axis=-1), np.ones((3, 5)), what="each row of weights must sum to 1",
                        hint=STABILITY_HINT)


# --- task 3: the loop over heads ----------------------------------------------------------------


def _layer_inputs(salt: int, B: int = 3, L: int = 5, d_model: int = 12, h: int = 3):
    layer = MultiHeadAttention(d_model, h, seed=int(_rng(90_000 + salt).integers(2**31)))
    X = _rng(salt).normal(size=(B, L, d_model))
    return layer, X, (X, layer.W_Q, layer.W_K, layer.W_V, layer.W_O, h)


def _loop_output(result, what: str):
    checks.expect_true(isinstance(result, tuple) and len(result) == 2,
                       what=f"{what}: expected a tuple (output, head_weights), got {type(result).__name__}",
                       hint="return output, head_weights [bug: return-output-head-weights]")
    return result


def _loop_hint(got, layer, X, mask, other: str, weights: bool = False) -> str:
    """LOOP_SCALE_HINT when ``got`` (the output, or the list of head weights) is what a loop whose scores are
    divided by sqrt(d_model) gives, else ``other``."""
    wrong = copy.copy(layer)
    wrong.W_Q = layer.W_Q * np.sqrt(layer.d_k / layer.d_model)  # then attention's 1/sqrt(d_k) gives 1/sqrt(d_model)
    candidate = wrong.forward(X, mask=mask)
    candidates = wrong.head_attention_weights if weights else [candidate]
    pieces = list(got) if weights and hasattr(got, "__len__") else [got]
    same = len(pieces) == len(candidates) and all(np.shape(a) == b.shape and np.allclose(a, b, rtol=1e-8, atol=1e-10)
                                                  for a, b in zip(pieces, candidates, strict=True))
    return LOOP_SCALE_HINT if same else other


def test_mha_loop_shape(student):
    layer, X, args = _layer_inputs(9)

    result = checks.call_replacing(student, REFERENCE_ATTENTION, "mha_forward_loop", *args)

    out, _ = _loop_output(result, "mha_forward_loop")
    checks.expect_array(out, what="mha_forward_loop output (B=3, L=5, d_model=12, h=3)", shape=(3, 5, 12))


def test_mha_loop_values(student):
    layer, X, args = _layer_inputs(10, B=2, L=7, d_model=12, h=4)
    expected = layer.forward(X)

    result = checks.call_replacing(student, REFERENCE_ATTENTION, "mha_forward_loop", *args)

    out, _ = _loop_output(result, "mha_forward_loop")
    checks.expect_array(out, what="mha_forward_loop output", shape=expected.shape)
    checks.expect_close(out, expected, what="mha_forward_loop output vs the fused layer",
                        hint=_loop_hint(out, layer, X, None,
                                        "head i uses columns i*d_k:(i+1)*d_k of W_Q, W_K, W_V and rows i*d_k:(i+1)*d_k "
                                        "of W_O, and the heads' contributions are added [bug: head-slices]"))


def test_mha_loop_mask(student):
    layer, X, args = _layer_inputs(11, B=2, L=6, d_model=8, h=2)
    causal = create_causal_mask(6)
    expected = layer.forward(X, mask=causal)

    result = checks.call_replacing(student, REFERENCE_ATTENTION, "mha_forward_loop", *args, mask=causal[0, 0])

    out, _ = _loop_output(result, "mha_forward_loop with a causal mask")
    checks.expect_array(out, what="mha_forward_loop output with a causal mask", shape=expected.shape)
    checks.expect_close(out, expected, what="mha_forward_loop with a causal mask vs the fused layer",
                        hint=_loop_hint(out, layer, X, causal, "pass the mask to every head's attention, and slice "
                                        "W_O by rows [bug: mask-per-head]"))


def test_mha_loop_weights(student):
    layer, X, args = _layer_inputs(12, B=2, L=5, d_model=12, h=3)
    layer.forward(X)
    expected = layer.head_attention_weights  # h arrays of shape (B, L, L)

    result = checks.call_replacing(student, REFERENCE_ATTENTION, "mha_forward_loop", *args)

    _, weights = _loop_output(result, "mha_forward_loop")
    n = len(weights) if hasattr(weights, "__len__") else None
    checks.expect_true(n == 3,
                       what=f"head_weights: expected a list of h=3 arrays of shape (B, L, L) = (2, 5, 5), got "
                            f"{type(weights).__name__} of length {n}",
                       hint="return a list with one (B, L, L) matrix per head, not one array stacked along "
                            "another axis [bug: head-weights-list]")
    for i, (w, ref) in enumerate(zip(weights, expected, strict=True)):
        checks.expect_array(w, what=f"head_weights[{i}] (a list of h arrays of shape (B, L, L))", shape=ref.shape)
        checks.expect_close(w, ref, what=f"head_weights[{i}]", hint=_loop_hint(
            weights, layer, X, None, "head i's weights come from head i's slices [bug: head-weights-slices]",
            weights=True))
