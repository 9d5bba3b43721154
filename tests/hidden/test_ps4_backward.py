"""Hidden checks of ps4_backward: mha_backward, numerical_gradient, gradient_check.

Every check has three steps: make the inputs (seeded, shapes the visible tests do not use),
call the student's function through ``checks.call``, judge the result. Expected gradients come
from ``mha_lab.cpu.MultiHeadAttention.backward``; to name a bug, the judge also compares the
answer with the gradients that known bugs would give.
"""

from dataclasses import dataclass

import numpy as np

from mha_lab.cpu import MultiHeadAttention, create_causal_mask, merge_heads, split_heads
from mha_lab.gradcheck import numerical_gradient, relative_error
from mha_lab.grading import checks
from mha_lab.grading.references import Array, Function, Number, Reference
from mha_lab.testing import GRADCHECK_MAX_REL_ERROR

# the package's own code for each task (the book prints it): what the class report's similarity compares answers with
PACKAGE_ANSWERS = {"mha_backward": ["mha_lab.cpu.GroupedQueryAttention.backward",
                                    "mha_lab.cpu.scaled_dot_product_attention_backward",
                                    "mha_lab.cpu.softmax_backward"],
                   "numerical_gradient": ["mha_lab.gradcheck.numerical_gradient"],
                   "gradient_check": ["mha_lab.gradcheck.check_layer_gradients"]}

WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")
BIASES = ("b_Q", "b_K", "b_V", "b_O")
_rng = checks.fresh_inputs()  # new inputs in every grading run


@dataclass
class Case:
    """One backward problem: the student's inputs and mha_lab's answer."""

    cache: dict
    grad_out: np.ndarray
    expected_x: np.ndarray
    expected: dict
    label: str


def _case(seed: int, B: int, L: int, d_model: int, h: int, causal: bool = False, bias: bool = False) -> Case:
    """Run mha_lab's layer forward and backward; build the cache the notebook's mha_forward returns."""
    rng = _rng(seed)
    layer = MultiHeadAttention(d_model, h, use_bias=bias, seed=int(_rng(90_000 + seed).integers(2**31)))
    if bias:
        for n in BIASES:
            setattr(layer, n, 0.1 * rng.standard_normal(d_model))
    X = rng.standard_normal((B, L, d_model))
    G = rng.standard_normal((B, L, d_model))
    mask = create_causal_mask(L) if causal else None
    layer.forward(X, mask)
    params = {n: getattr(layer, n).copy() for n in layer.parameters()}
    Q, K, V = (split_heads(X @ params[f"W_{n}"] + params.get(f"b_{n}", 0.0), h) for n in "QKV")  # (B, h, L, d_k)
    A = layer.attention_weights.copy()  # (B, h, L, L)
    cache = {"X": X.copy(), "Q": Q, "K": K, "V": V, "A": A, "concat": merge_heads(A @ V), "params": params}
    expected_x = layer.backward(G)
    label = f"B={B}, L={L}, d_model={d_model}, num_heads={h}" + (", causal mask" if causal else "")
    return Case(cache, G, expected_x, {n: g.copy() for n, g in layer.gradients().items()}, label)


def _call_backward(student, case: Case):
    """Step 2: the student's mha_backward on a copy of the cache; checks the (grad_X, grads) form."""
    cache = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.cache.items()}
    cache["params"] = {k: v.copy() for k, v in case.cache["params"].items()}
    result = checks.call(student, "mha_backward", cache, case.grad_out.copy())
    checks.expect_true(isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict),
                       what=f"mha_backward should return a pair (grad_X, grads) with grads a dict, got "
                            f"{type(result).__name__}", hint="end with `return grad_X, grads` [bug: return-grads]")
    return result


# --- the gradients that known bugs give, to name the bug -----------------------------------------


def _steps(case: Case, *, scale: bool = True, row_sum: bool = True, transpose_grad_S: bool = True,
           transpose_in_step6: bool = True) -> dict:
    """Steps 2 to 6 written with einsum, with one known bug switched on when a flag is False."""
    c, G = case.cache, case.grad_out
    B, h, L, d_k = c["Q"].shape
    grad_Z = split_heads(G @ c["params"]["W_O"].T, h)  # (B, L, d_model) -> (B, h, L, d_k)
    grad_A = np.einsum("bhid,bhjd->bhij", grad_Z, c["V"])
    grad_V = np.einsum("bhji,bhjd->bhid", c["A"], grad_Z)
    row = np.einsum("bhij,bhij->bhi", grad_A, c["A"])[..., None] if row_sum else 0.0
    grad_S = c["A"] * (grad_A - row) / (np.sqrt(d_k) if scale else 1.0)
    grad_Q = np.einsum("bhij,bhjd->bhid", grad_S, c["K"])
    grad_K = np.einsum("bhji,bhjd->bhid", grad_S if transpose_grad_S else grad_S.swapaxes(-1, -2), c["Q"])

    def flat(g):  # (B, h, L, d_k) -> (B, L, d_model), or the bug: reshape without transposing
        return merge_heads(g) if transpose_in_step6 else g.reshape(B, L, h * d_k)

    return {"Q": flat(grad_Q), "K": flat(grad_K), "V": flat(grad_V)}


def _weight_grads(case: Case, flats: dict) -> dict:
    X2 = case.cache["X"].reshape(-1, case.cache["X"].shape[-1])  # (B, L, d_model) -> (B*L, d_model)
    return {f"W_{n}": X2.T @ flats[n].reshape(X2.shape) for n in "QKV"}


def _matches(actual, expected) -> bool:
    actual = np.asarray(actual)
    return actual.shape == np.shape(expected) and bool(np.allclose(actual, expected, rtol=1e-8, atol=1e-10))


def _known_bug(case: Case, name: str, actual) -> str | None:
    """The known bug whose gradient ``name`` equals ``actual``, if any."""
    d_k = case.cache["Q"].shape[-1]
    if name == "W_O" and _matches(actual, case.expected["W_O"].T):
        return ("grad_W_O is transposed: grad_W_O = concat^T @ grad_out (shaped like W_O), not grad_out^T @ concat"
                " [bug: grad-w-o-transposed]")
    if name in ("W_Q", "W_K") and _matches(actual, np.sqrt(d_k) * case.expected[name]):
        return (f"grad_{name} is sqrt(d_k) times too large: step 5 misses the 1/sqrt(d_k) of the scores"
                " [bug: missing-scale]")
    if name in ("W_Q", "W_K") and _matches(actual, _weight_grads(case, _steps(case, row_sum=False))[name]):
        return ("the softmax backward (step 4) is missing the row-sum term: "
                "grad_S = A * (grad_A - rowsum(grad_A * A)) [bug: softmax-backward-row-sum]")
    if name == "W_K" and _matches(actual, _weight_grads(case, _steps(case, transpose_grad_S=False))[name]):
        return ("grad_K must use grad_S^T (transpose the last two axes): grad_K = grad_S^T @ Q, not grad_S @ Q"
                " [bug: grad-k-no-transpose]")
    unsplit = _weight_grads(case, _steps(case, transpose_in_step6=False))
    if name in ("W_Q", "W_K", "W_V") and _matches(actual, unsplit[name]):
        return ("step 6 reshapes without transposing: (B, h, L, d_k) -> transpose(0, 2, 1, 3) -> "
                "(B, L, h, d_k) -> reshape -> (B, L, d_model) [bug: merge-no-transpose]")
    return None


def _judge_weight(case: Case, grads: dict, name: str, hint: str) -> None:
    what = f"grad {name} ({case.label})"
    checks.expect_true(name in grads, what=f"{what}: grads has no key {name!r} (keys: {sorted(grads)})",
                       hint="store every gradient under the parameter's name, e.g. grads['W_Q'] [bug: grads-keys]")
    checks.expect_array(grads[name], what=what, shape=case.expected[name].shape)
    checks.expect_close(grads[name], case.expected[name], what=what,
                        hint=_known_bug(case, name, grads[name]) or hint)


CASES = {
    "": dict(seed=31, B=2, L=5, d_model=12, h=3),
    "causal": dict(seed=32, B=3, L=6, d_model=8, h=4, causal=True),
}


# --- shapes --------------------------------------------------------------------------------------


def test_mha_backward_shapes(student):
    # 1. inputs
    case = _case(30, B=2, L=7, d_model=6, h=2)
    # 2. call
    grad_X, grads = _call_backward(student, case)
    # 3. judge
    checks.expect_array(grad_X, what=f"grad_X ({case.label})", shape=case.expected_x.shape)
    checks.expect_true(set(grads) == set(WEIGHTS), what=f"grads has keys {sorted(grads)}, expected {list(WEIGHTS)}",
                       hint="one entry per parameter of the forward, named like params [bug: grads-keys]")
    for name in WEIGHTS:
        checks.expect_array(grads[name], what=f"grad {name} ({case.label})", shape=case.expected[name].shape)


# --- one property per gradient, each without and with a causal mask ------------------------------


def _check_weight(student, key: str, names: tuple[str, ...], hint: str):
    # 1. inputs
    case = _case(**CASES[key])
    # 2. call
    _, grads = _call_backward(student, case)
    # 3. judge
    for name in names:
        _judge_weight(case, grads, name, hint)


W_O_HINT = "step 1: grad_W_O = concat^T @ grad_out, summed over batch and positions [bug: grad-w-o]"


def test_mha_backward_grad_W_O(student):
    _check_weight(student, "", ("W_O",), W_O_HINT)


def test_mha_backward_grad_W_O__causal(student):
    _check_weight(student, "causal", ("W_O",), W_O_HINT)


W_V_HINT = ("step 2 splits grad_concat into heads (reshape to (B, L, h, d_k), then transpose); step 3: "
            "grad_V = A^T @ grad_Z; step 6 transposes back before reshaping [bug: grad-w-v]")


def test_mha_backward_grad_W_V(student):
    _check_weight(student, "", ("W_V",), W_V_HINT)


def test_mha_backward_grad_W_V__causal(student):
    _check_weight(student, "causal", ("W_V",), W_V_HINT)


W_QK_HINT = ("step 3: grad_A = grad_Z @ V^T; step 4: grad_S = A * (grad_A - rowsum(grad_A * A)); step 5: divide by "
             "sqrt(d_k), grad_Q = grad_S @ K, grad_K = grad_S^T @ Q [bug: grad-w-qk]")


def test_mha_backward_grad_W_QK(student):
    _check_weight(student, "", ("W_Q", "W_K"), W_QK_HINT)


def test_mha_backward_grad_W_QK__causal(student):
    _check_weight(student, "causal", ("W_Q", "W_K"), W_QK_HINT)


def _grad_X_hint(case: Case, grads: dict, grad_X) -> str:
    """Which of the three branches of grad_X are present, when that explains the answer."""
    p = case.cache["params"]
    flats = _steps(case)
    branches = {n: flats[n] @ p[f"W_{n}"].T for n in "QKV"}
    for missing in "QKV":
        if _matches(grad_X, sum(b for n, b in branches.items() if n != missing)):
            return (f"grad_X is missing the {missing} branch: X feeds Q, K and V, so "
                    "grad_X = grad_Q W_Q^T + grad_K W_K^T + grad_V W_V^T [bug: grad-x-missing-branch]")
    for name in ("W_Q", "W_K", "W_V"):
        if name in grads and _known_bug(case, name, grads[name]):
            return (f"grad_X sums the three branches, so it inherits the bug in grad {name}: fix that first"
                    " [bug: grad-x-inherits]")
    return ("grad_X = grad_Q W_Q^T + grad_K W_K^T + grad_V W_V^T, with the branches reshaped back to (B, L, d_model)"
            " [bug: grad-x]")


def _check_grad_X(student, key: str):
    # 1. inputs
    case = _case(**CASES[key])
    # 2. call
    grad_X, grads = _call_backward(student, case)
    # 3. judge
    what = f"grad_X ({case.label})"
    checks.expect_array(grad_X, what=what, shape=case.expected_x.shape)
    checks.expect_close(grad_X, case.expected_x, what=what, hint=_grad_X_hint(case, grads, grad_X))


def test_mha_backward_grad_X(student):
    _check_grad_X(student, "")


def test_mha_backward_grad_X__causal(student):
    _check_grad_X(student, "causal")


def test_mha_backward_grad_b(student):
    # 1. inputs
    case = _case(33, B=3, L=5, d_model=8, h=2, causal=True, bias=True)
    # 2. call
    _, grads = _call_backward(student, case)
    # 3. judge
    for name in BIASES:
        what = f"grad {name} ({case.label}, with biases)"
        checks.expect_true(name in grads, what=f"{what}: grads has no key {name!r}",
                           hint="with biases in params, return their gradients too [bug: bias-grads]")
        hint = ("a bias gradient is the branch's gradient summed over batch AND positions: .sum(axis=(0, 1)), "
                "shape (d_model,) [bug: bias-sum]")
        shape = np.shape(grads[name])
        checks.expect_true(shape == case.expected[name].shape,
                           what=f"{what}: expected shape {case.expected[name].shape}, got {shape}", hint=hint)
        checks.expect_array(grads[name], what=what, shape=case.expected[name].shape)
        if name != "b_O":
            n = name[-1]
            hint = checks.retag(hint, note=f"; if grad W_{n} is wrong too, fix that first")
        checks.expect_close(grads[name], case.expected[name], what=what, hint=hint)


# --- numerical_gradient --------------------------------------------------------------------------


def _judge_numerical(grad, exact: np.ndarray, what: str) -> None:
    """Central differences with eps = 1e-5 are within ~1e-10 of the exact gradient; one-sided ones ~1e-5."""
    checks.expect_array(grad, what=what, shape=exact.shape)
    err = float(np.max(np.abs(grad - exact)))
    if err > 1e-7:
        one_sided = 1e-6 < err < 1e-3
        raise AssertionError(
            f"{what}: max abs error {err:.2g} against the exact gradient; central differences give about 1e-10. "
            + ("Likely bug: a one-sided (forward) difference (f(x + eps) - f(x)) / eps, whose error is O(eps); use "
               "the central difference (f(x + eps) - f(x - eps)) / (2 eps) [bug: one-sided-difference]"
               if one_sided else
               "Likely bug: perturb every entry x[idx] (np.ndindex(x.shape)) by +eps and -eps in place, divide by "
               "2 eps, and restore x[idx] before the next entry [bug: numerical-gradient]"))


def test_numerical_gradient_values__central(student):
    # 1. inputs
    x = _rng(40).uniform(-2, 2, size=(3, 4))
    f = checks.SmoothLoss(x)
    exact = f.exact()
    # 2. call
    grad = checks.call(student, "numerical_gradient", f, x, 1e-5)
    # 3. judge
    _judge_numerical(grad, exact, "numerical_gradient of sum(sin(x) x^2), x of shape (3, 4), eps=1e-5")


def test_numerical_gradient_values__3d(student):
    # 1. inputs
    x = _rng(42).uniform(-1, 1, size=(2, 3, 2))
    f = checks.SmoothLoss(x)
    exact = f.exact()
    # 2. call
    grad = checks.call(student, "numerical_gradient", f, x, 1e-5)
    # 3. judge
    _judge_numerical(grad, exact, "numerical_gradient of sum(sin(x) x^2), x of shape (2, 3, 2), eps=1e-5")


# --- gradient_check ------------------------------------------------------------------------------

# gradient_check is judged on its own: during its call, the student's numerical_gradient is mha_lab's,
# so a bug there is charged once (to numerical_gradient_values), not twice.
TRUSTED_NUMERICAL_GRADIENT = {"numerical_gradient": Reference("mha_lab.gradcheck.numerical_gradient", (
    ("f", Function()), ("x", Array((0, 4))), ("eps", Number(1e-12, 1.0))), 2)}


def _reference_check_error(case: Case, mask: np.ndarray) -> float:
    """The largest relative error mha_lab's own gradient check reports on ``case``'s right gradients."""
    params = {k: v.copy() for k, v in case.cache["params"].items()}
    X = case.cache["X"].copy()
    layer = MultiHeadAttention(X.shape[-1], 2, use_bias=False)
    for name, value in params.items():
        setattr(layer, name, value)  # the same arrays: perturbing params[name] perturbs the layer

    def loss() -> float:
        return float(np.sum(layer.forward(X, mask) * case.grad_out))

    errors = [relative_error(case.expected[n], numerical_gradient(loss, params[n])) for n in WEIGHTS]
    return max(*errors, relative_error(case.expected_x, numerical_gradient(loss, X)))


def _gradient_check_inputs(seed: int):
    """A small causal problem (no biases) and mha_lab's gradients for it, drawn again until a right gradient checks
    at most 1/100 of the pass mark: where an entry of a gradient lies near zero (yet above relative_error's
    zero_tol), central differences' rounding alone reads as a relative error near 1e-5 (about 1 draw in 5,000), and a
    right answer must never fail on the numbers it was handed."""
    mask = create_causal_mask(3)
    for attempt in range(100):
        case = _case(seed + 100_000 * attempt, B=2, L=3, d_model=4, h=2, causal=True)
        if _reference_check_error(case, mask) <= GRADCHECK_MAX_REL_ERROR / 100:
            break
    X, params = case.cache["X"].copy(), {k: v.copy() for k, v in case.cache["params"].items()}
    return case, X, params, mask


def _judge_report(report, case: Case, wrong: str | None) -> None:
    names = set(WEIGHTS) | {"X"}
    checks.expect_true(isinstance(report, dict) and set(report) == names,
                       what=f"gradient_check should return a dict with keys {sorted(names)}, got "
                            f"{sorted(report) if isinstance(report, dict) else type(report).__name__}",
                       hint="one relative error per parameter name, plus 'X' [bug: report-keys]")
    for name, err in report.items():
        checks.expect_true(np.isscalar(err) and np.isfinite(err), what=f"gradient_check[{name!r}] = {err!r}",
                           hint="each entry is a float: relative_error(analytic, numerical) [bug: report-floats]")
        if name == wrong:
            checks.expect_true(err > 1e-3, what=f"gradient_check reports {err:.2g} for {name}, whose analytic "
                               "gradient was deliberately wrong", hint="compare analytic[name] with the numerical "
                               "gradient of the loss with respect to params[name], perturbed in place"
                               " [bug: check-compare]")
        else:
            checks.expect_true(err < GRADCHECK_MAX_REL_ERROR, what=f"gradient_check reports {err:.2g} for {name} "
                               f"({case.label}) although the analytic gradient is right",
                               hint="loss = sum(mha_forward(X, params, num_heads, mask)[0] * grad_out); use central "
                                    "differences with the given eps, perturbing params[name] (or X) in place"
                                    " [bug: numerical-gradient]")


def test_gradient_check_report__correct_backward(student):
    # 1. inputs: the right analytic gradients
    case, X, params, mask = _gradient_check_inputs(50)
    analytic = (case.expected_x.copy(), {n: case.expected[n].copy() for n in WEIGHTS})
    # 2. call
    report = checks.call_replacing(student, TRUSTED_NUMERICAL_GRADIENT, "gradient_check", X, params, 2, case.grad_out,
                                   analytic, mask, 1e-5)
    # 3. judge
    _judge_report(report, case, wrong=None)


def test_gradient_check_report__wrong_backward(student):
    # 1. inputs: analytic gradients with grad_W_K off (the gradient of a backward that forgot the transpose)
    case, X, params, mask = _gradient_check_inputs(51)
    grads = {n: case.expected[n].copy() for n in WEIGHTS}
    grads["W_K"] = _weight_grads(case, _steps(case, transpose_grad_S=False))["W_K"]
    # 2. call
    report = checks.call_replacing(student, TRUSTED_NUMERICAL_GRADIENT, "gradient_check", X, params, 2, case.grad_out,
                                   (case.expected_x.copy(), grads), mask, 1e-5)
    # 3. judge
    _judge_report(report, case, wrong="W_K")
