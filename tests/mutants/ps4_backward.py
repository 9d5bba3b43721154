"""Known bugs in ps4_backward, each in one answer cell, and the tests cells they must fail."""

from tests.mutants import Mutant

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
           '    layer = reference_layer(cache["params"], cache["Q"].shape[1])\n'
           '    layer.forward(cache["X"])\n'
           '    return layer.backward(grad_out), layer.gradients()\n',
           {"mha_backward_shapes", "mha_backward_grad_W_O", "mha_backward_grad_W_V", "mha_backward_grad_W_QK",
            "mha_backward_grad_X", "mha_backward_grad_b"}, "uses mha_lab.cpu.MultiHeadAttention"),
    Mutant("forward_difference", "numerical_gradient",
           "        x[idx] = orig - eps\n        f_minus = f()\n        x[idx] = orig\n"
           "        grad[idx] = (f_plus - f_minus) / (2 * eps)",
           "        x[idx] = orig\n        f_minus = f()\n        grad[idx] = (f_plus - f_minus) / eps",
           {"numerical_gradient_values"}, "forward) difference"),
    Mutant("gradient_check_perturbs_a_copy", "gradient_check",
           "numerical_gradient(loss, params[name], eps)", "numerical_gradient(loss, params[name].copy(), eps)",
           {"gradient_check_report"}, "perturbing params[name] (or X) in place"),
]
