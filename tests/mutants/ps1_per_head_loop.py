"""One-bug variants of the ps1_per_head_loop solution, each with the tests cells it must fail."""

from tests.mutants import Mutant

SPLIT = "x.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)"

MUTANTS = [
    Mutant("split: reshape without transpose", "ans_split_heads", SPLIT, "x.reshape(B, num_heads, L, d_k)",
           breaks={"split_heads_values"}, feedback="reshape without transposing"),
    Mutant("split: transpose before reshape", "ans_split_heads", SPLIT,
           "x.transpose(0, 2, 1).reshape(B, num_heads, L, d_k)",
           breaks={"split_heads_values"}, feedback="transpose before reshaping"),
    Mutant("merge: reshape without transpose", "ans_merge_heads",
           "x.transpose(0, 2, 1, 3).reshape(B, L, h * d_k)", "x.reshape(B, L, h * d_k)",
           breaks={"merge_heads_values"}, feedback="reshape without transposing"),
    Mutant("attention: scale by 1/d_k", "ans_attention", "/ np.sqrt(d_k)", "/ d_k",
           breaks={"attention_values", "attention_mask"}, feedback="1/sqrt(d_k)"),
    Mutant("attention: inverted mask", "ans_attention", "scores = scores + mask",
           "scores = np.where(mask == 0, -np.inf, scores)",
           breaks={"attention_mask", "mha_loop_mask"}, feedback="mask inverted"),
    Mutant("attention: softmax without the max", "ans_attention",
           "scores = scores - scores.max(axis=-1, keepdims=True)  # the largest exponent is 0: no overflow",
           "pass",
           breaks={"attention_stability"}, feedback="row maximum"),
    Mutant("loop: W_O sliced by columns", "ans_mha_forward_loop", "W_O[cols, :]", "W_O[:, cols].T",
           breaks={"mha_loop_values", "mha_loop_mask"}, feedback="rows i*d_k:(i+1)*d_k"),
    Mutant("loop: weights stacked along the batch axis", "ans_mha_forward_loop", "return out, head_weights",
           "return out, np.stack(head_weights, axis=1)",
           breaks={"mha_loop_weights"}, feedback="not one array stacked along another axis"),
    Mutant("loop: answer taken from mha_lab", "ans_mha_forward_loop", "    return out, head_weights",
           "    from mha_lab.cpu import per_head_attention, MultiHeadAttention\n"
           "    layer = MultiHeadAttention(X.shape[-1], num_heads)\n"
           "    layer.W_Q, layer.W_K, layer.W_V, layer.W_O = W_Q, W_K, W_V, W_O\n"
           "    return per_head_attention(X, layer, mask)",
           breaks={"mha_loop_shape", "mha_loop_values", "mha_loop_mask", "mha_loop_weights"},
           feedback="uses mha_lab.cpu."),
]
