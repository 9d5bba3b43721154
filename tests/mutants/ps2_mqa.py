"""One-bug variants of the ps2_mqa solution, each with the tests cells it must fail."""

from tests.mutants import Mutant

MUTANTS = [
    Mutant("mqa: scale by sqrt(d_model)", "ans_mqa_forward", "/ np.sqrt(d_k)", "/ np.sqrt(d_model)",
           breaks={"mqa_forward_values", "mqa_forward_mask"}, feedback="not by 1/sqrt(d_model)"),
    Mutant("mqa: inverted mask", "ans_mqa_forward", "scores = scores + mask",
           "scores = np.where(mask == 0, -np.inf, scores)",
           breaks={"mqa_forward_mask"}, feedback="inverted"),
    Mutant("mqa: query heads reshaped without transpose", "ans_mqa_forward",
           "(X @ W_Q).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)",
           "(X @ W_Q).reshape(B, num_heads, L, d_k)",
           breaks={"mqa_forward_values", "mqa_forward_mask"}, feedback="reshape without transposing"),
    Mutant("mqa: answer taken from mha_lab", "ans_mqa_forward", "    B, L, d_model = X.shape\n",
           "    from mha_lab.cpu import GroupedQueryAttention\n"
           "    layer = GroupedQueryAttention(X.shape[-1], num_heads, 1)\n"
           "    layer.W_Q, layer.W_K, layer.W_V, layer.W_O = W_Q, W_K, W_V, W_O\n"
           "    return layer.forward(X, mask)\n",
           breaks={"mqa_forward_shape", "mqa_forward_values", "mqa_forward_mask"},
           feedback="uses mha_lab.cpu.GroupedQueryAttention"),
    Mutant("gqa: np.tile instead of np.repeat", "ans_gqa_forward",
           "np.repeat(K, n_rep, axis=1), np.repeat(V, n_rep, axis=1)",
           "np.tile(K, (1, n_rep, 1, 1)), np.tile(V, (1, n_rep, 1, 1))",
           breaks={"gqa_forward_values"}, feedback="repeat_interleave"),
    Mutant("gqa: heads merged without transpose", "ans_gqa_forward",
           "Z.transpose(0, 2, 1, 3).reshape(B, L, d_model)", "Z.reshape(B, L, d_model)",
           breaks={"gqa_forward_values", "gqa_forward_limits"}, feedback="reshape without transposing"),
    Mutant("kv cache: no factor 2", "ans_kv_cache_bytes", "return 2 * n_layers", "return n_layers",
           breaks={"kv_cache_bytes_values"}, feedback="forget the factor of 2"),
    Mutant("kv cache: answer taken from mha_lab", "ans_kv_cache_bytes", "    return 2 * n_layers",
           "    from mha_lab.analysis import ModelConfig, kv_cache_bytes as reference\n"
           "    config = ModelConfig('any', n_layers, n_kv_heads * head_dim, n_kv_heads, n_kv_heads, head_dim)\n"
           "    dtype = {1: 'int8', 2: 'float16', 4: 'float32', 8: 'float64'}[bytes_per_element]\n"
           "    return reference(config, seq_len, batch_size, dtype)\n    return 2 * n_layers",
           breaks={"kv_cache_bytes_values"}, feedback="uses mha_lab.analysis.kv_cache_bytes"),
]
