"""Known bugs in ps4_backward, each in one answer cell, and the tests cells they must fail;
and correct solutions written differently, which must keep every point."""

from tests.mutants import NOT_AVAILABLE, Mutant, Variant

BWD = "mha_backward"
# A bug in steps 4 to 6 reaches grad_W_Q/grad_W_K, grad_X (their sum) and the Q/K bias gradients.
QK_DOWNSTREAM = {"mha_backward_grad_W_QK", "mha_backward_grad_X", "mha_backward_grad_b"}

MUTANTS = [
    Mutant("grad_X_without_K_branch", BWD,
           'grad_X = grad_Qf @ params["W_Q"].T + grad_Kf @ params["W_K"].T + grad_Vf @ params["W_V"].T',
           'grad_X = grad_Qf @ params["W_Q"].T + grad_Vf @ params["W_V"].T',
           {"mha_backward_grad_X"}, "grad_X is missing the K branch"),
    Mutant("softmax_backward_without_row_sum", BWD,
           "grad_S = A * (grad_A - (grad_A * A).sum(axis=-1, keepdims=True))", "grad_S = A * grad_A",
           QK_DOWNSTREAM, "missing the row-sum term"),
    Mutant("step5_without_scale", BWD,
           "grad_S = grad_S / np.sqrt(d_k)", "grad_S = grad_S",
           QK_DOWNSTREAM, "misses the 1/sqrt(d_k)"),
    Mutant("grad_K_without_transpose", BWD,
           "grad_K = grad_S.transpose(0, 1, 3, 2) @ Q", "grad_K = grad_S @ Q",
           QK_DOWNSTREAM, "grad_K must use grad_S^T"),
    Mutant("step6_reshape_without_transpose", BWD,
           "grad_Vf = grad_V.transpose(0, 2, 1, 3).reshape(B, L, d_model)",
           "grad_Vf = grad_V.reshape(B, L, d_model)",
           {"mha_backward_grad_W_V", "mha_backward_grad_X", "mha_backward_grad_b"},
           "step 6 reshapes without transposing"),
    Mutant("grad_W_O_transposed", BWD,
           'grads["W_O"] = concat.reshape(B * L, d_model).T @ grad_out.reshape(B * L, d_model)',
           'grads["W_O"] = grad_out.reshape(B * L, d_model).T @ concat.reshape(B * L, d_model)',
           {"mha_backward_grad_W_O"}, "grad_W_O is transposed"),
    Mutant("bias_gradient_summed_over_batch_only", BWD,
           'grads["b_O"] = grad_out.sum(axis=(0, 1))', 'grads["b_O"] = grad_out.sum(axis=0)',
           {"mha_backward_grad_b"}, "summed over batch AND positions"),
    Mutant("answer_from_mha_lab", BWD,
           '    X, Q, K, V, A, concat, params = (cache[n] for n in ("X", "Q", "K", "V", "A", "concat", "params"))\n',
           '    from mha_lab.cpu import MultiHeadAttention\n'
           '    p = cache["params"]\n'
           '    layer = MultiHeadAttention(cache["X"].shape[-1], cache["Q"].shape[1], use_bias="b_Q" in p)\n'
           '    for name, value in cache["params"].items():\n'
           '        setattr(layer, name, value)\n'
           '    layer.forward(cache["X"])\n'
           '    return layer.backward(grad_out), layer.gradients()\n',
           {"mha_backward_shapes", "mha_backward_grad_W_O", "mha_backward_grad_W_V", "mha_backward_grad_W_QK",
            "mha_backward_grad_X", "mha_backward_grad_b"}, NOT_AVAILABLE),
    Mutant("forward_difference", "numerical_gradient",
           "        x[idx] = orig - eps\n        f_minus = f()\n        x[idx] = orig\n"
           "        grad[idx] = (f_plus - f_minus) / (2 * eps)",
           "        x[idx] = orig\n        f_minus = f()\n        grad[idx] = (f_plus - f_minus) / eps",
           {"numerical_gradient_values"}, "forward) difference"),
    Mutant("gradient_check_perturbs_a_copy", "gradient_check",
           "numerical_gradient(loss, params[name], eps)", "numerical_gradient(loss, params[name].copy(), eps)",
           {"gradient_check_report"}, "perturbing params[name] (or X) in place"),
]

# --- correct solutions written differently ------------------------------------------------------

BACKWARD_EINSUM = '''def mha_backward(cache, grad_out):
    """The seven steps with einsum; no reshape of the batch into rows."""
    X, Q, K, V, A, concat, params = (cache[n] for n in ("X", "Q", "K", "V", "A", "concat", "params"))
    B, h, L, d_k = Q.shape
    grads = {"W_O": np.einsum("bli,blj->ij", concat, grad_out)}
    grad_Z = np.einsum("blj,ij->bli", grad_out, params["W_O"]).reshape(B, L, h, d_k)  # (B, L, h, d_k)
    grad_A = np.einsum("blhd,bhmd->bhlm", grad_Z, V)
    grad_V = np.einsum("bhlm,blhd->bhmd", A, grad_Z)
    grad_S = A * (grad_A - np.einsum("bhlm,bhlm->bhl", grad_A, A)[..., None]) / np.sqrt(d_k)
    grad_Q = np.einsum("bhlm,bhmd->blhd", grad_S, K).reshape(B, L, h * d_k)
    grad_K = np.einsum("bhlm,bhld->bmhd", grad_S, Q).reshape(B, L, h * d_k)
    grad_V = np.einsum("bhmd->bmhd", grad_V).reshape(B, L, h * d_k)
    grad_X = 0
    for n, g in (("Q", grad_Q), ("K", grad_K), ("V", grad_V)):
        grads["W_" + n] = np.einsum("bli,blj->ij", X, g)
        grad_X = grad_X + np.einsum("blj,ij->bli", g, params["W_" + n])
        if "b_" + n in params:
            grads["b_" + n] = np.einsum("blj->j", g)
    if "b_O" in params:
        grads["b_O"] = np.einsum("blj->j", grad_out)
    return grad_X, grads
'''

NUMERICAL_FLAT = '''def numerical_gradient(f, x, eps=1e-5):
    """x.flat: one loop over the entries in C order, whatever x's shape or strides."""
    grad = np.empty(x.size)
    for i in range(x.size):
        keep = x.flat[i]
        x.flat[i] = keep + eps
        up = f()
        x.flat[i] = keep - eps
        down = f()
        x.flat[i] = keep
        grad[i] = (up - down) / (2 * eps)
    return grad.reshape(x.shape)
'''

CHECK_LOOP = '''def gradient_check(X, params, num_heads, grad_out, analytic, mask=None, eps=1e-5):
    """One name at a time, X last."""
    grad_X, grads = analytic
    loss = lambda: np.sum(mha_forward(X, params, num_heads, mask)[0] * grad_out)
    errors = {}
    for name in sorted(params):
        errors[name] = float(relative_error(grads[name], numerical_gradient(loss, params[name], eps)))
    errors["X"] = float(relative_error(grad_X, numerical_gradient(loss, X, eps)))
    return errors
'''

BACKWARD_PER_HEAD = '''def mha_backward(cache, grad_out):
    """A loop over heads: head i owns columns i*d_k:(i+1)*d_k of grad_Q, grad_K, grad_V."""
    X, Q, K, V, A, concat, params = (cache[n] for n in ("X", "Q", "K", "V", "A", "concat", "params"))
    B, h, L, d_k = Q.shape
    d_model = h * d_k
    grad_concat = grad_out @ params["W_O"].T
    flats = {n: np.zeros((B, L, d_model)) for n in "QKV"}
    for i in range(h):
        c = slice(i * d_k, (i + 1) * d_k)
        gz = grad_concat[:, :, c]  # (B, L, d_k)
        a = A[:, i]  # (B, L, L)
        ga = gz @ V[:, i].swapaxes(1, 2)
        gs = a * (ga - np.sum(ga * a, axis=-1, keepdims=True)) / np.sqrt(d_k)
        flats["Q"][:, :, c] = gs @ K[:, i]
        flats["K"][:, :, c] = gs.swapaxes(1, 2) @ Q[:, i]
        flats["V"][:, :, c] = a.swapaxes(1, 2) @ gz
    grads = {"W_O": sum(concat[b].T @ grad_out[b] for b in range(B))}
    grad_X = np.zeros_like(X)
    for n, g in flats.items():
        grads["W_" + n] = sum(X[b].T @ g[b] for b in range(B))
        grad_X += g @ params["W_" + n].T
    for n, g in (("Q", flats["Q"]), ("K", flats["K"]), ("V", flats["V"]), ("O", grad_out)):
        if "b_" + n in params:
            grads["b_" + n] = g.sum(axis=0).sum(axis=0)
    return grad_X, grads
'''

NUMERICAL_NDITER = '''def numerical_gradient(f, x, eps=1e-5):
    """np.nditer with a multi-index; the entry is restored from a saved copy."""
    grad = np.zeros(x.shape)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        saved = x[i].copy()
        x[i] = saved + eps
        f_plus = f()
        x[i] = saved - eps
        grad[i] = (f_plus - f()) / (2 * eps)
        x[i] = saved
    return grad
'''

CHECK_COMPREHENSION = '''def gradient_check(X, params, num_heads, grad_out, analytic, mask=None, eps=1e-5):
    def loss():
        out, _ = mha_forward(X, params, num_heads, mask)
        return float((out * grad_out).sum())

    targets = {**params, "X": X}  # the same arrays, perturbed in place
    wanted = {**analytic[1], "X": analytic[0]}
    return {n: relative_error(wanted[n], numerical_gradient(loss, t, eps)) for n, t in targets.items()}
'''

BACKWARD_IN_PLACE = '''def mha_backward(cache, grad_out):
    """Steps 3 to 5 written into one (B, h, L, L) buffer, in place."""
    X, Q, K, V, A, concat, params = (cache[n] for n in ("X", "Q", "K", "V", "A", "concat", "params"))
    B, h, L, d_k = Q.shape
    rows = grad_out.reshape(-1, h * d_k)  # (B*L, d_model)
    grads = {"W_O": concat.reshape(-1, h * d_k).T @ rows}
    grad_Z = np.moveaxis((grad_out @ params["W_O"].T).reshape(B, L, h, d_k), 2, 1)  # (B, h, L, d_k)
    grad_V = np.swapaxes(A, -1, -2) @ grad_Z
    G = grad_Z @ np.swapaxes(V, -1, -2)  # grad_A, then grad_S, in place
    G -= np.sum(G * A, axis=-1, keepdims=True)
    G *= A
    G /= np.sqrt(d_k)
    merged = {
        "Q": np.moveaxis(G @ K, 1, 2).reshape(B * L, h * d_k),
        "K": np.moveaxis(np.swapaxes(G, -1, -2) @ Q, 1, 2).reshape(B * L, h * d_k),
        "V": np.moveaxis(grad_V, 1, 2).reshape(B * L, h * d_k),
    }
    X2 = X.reshape(B * L, h * d_k)
    grad_X = np.zeros_like(X2)
    for n, g in merged.items():
        grads["W_" + n] = X2.T @ g
        grad_X += g @ params["W_" + n].T
        if "b_" + n in params:
            grads["b_" + n] = g.sum(axis=0)
    if "b_O" in params:
        grads["b_O"] = rows.sum(axis=0)
    return grad_X.reshape(X.shape), grads
'''

VARIANTS = [
    Variant("einsum backward, flat-view differences, a loop of checks",
            {BWD: BACKWARD_EINSUM, "numerical_gradient": NUMERICAL_FLAT, "gradient_check": CHECK_LOOP}),
    Variant("a loop over heads, nditer, a dict comprehension",
            {BWD: BACKWARD_PER_HEAD, "numerical_gradient": NUMERICAL_NDITER, "gradient_check": CHECK_COMPREHENSION}),
    Variant("steps 3 to 5 in one buffer, in place",
            {BWD: BACKWARD_IN_PLACE}),
]

# --- bugs that show only for a batch above 1: each must fail a visible test (``breaks``) of the release ---
# (numerical_gradient and gradient_check take no batch: their inputs are arrays of any shape.)

BATCH_MUTANTS = [
    Mutant("grad W_O: the mean over the batch", BWD,
           'grads["W_O"] = concat.reshape(B * L, d_model).T @ grad_out.reshape(B * L, d_model)',
           'grads["W_O"] = concat.reshape(B * L, d_model).T @ grad_out.reshape(B * L, d_model) / B',
           {"mha_backward_grad_W_O"}, "batch"),
    Mutant("grad W_V: the mean over the batch", BWD,
           'grads["W_V"] = X2.T @ grad_Vf.reshape(B * L, d_model)',
           'grads["W_V"] = X2.T @ grad_Vf.reshape(B * L, d_model) / B', {"mha_backward_grad_W_V"}, "batch"),
    Mutant("grad W_K: the mean over the batch", BWD,
           'grads["W_K"] = X2.T @ grad_Kf.reshape(B * L, d_model)',
           'grads["W_K"] = X2.T @ grad_Kf.reshape(B * L, d_model) / B', {"mha_backward_grad_W_QK"}, "batch"),
    Mutant("grad X: the first sequence's only", BWD,
           "grad_X = grad_Qf @ params", "grad_X = grad_Qf[:1] @ params", {"mha_backward_grad_X"}, "batch"),
]
