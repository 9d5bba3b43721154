"""Known bugs in ps3_memory_efficient, each in one answer cell, and the tests cells they must fail."""

from tests.mutants import Mutant

HBH = "head_by_head_forward"
CHUNKED = "chunked_attention"
CHUNKED_VALUES = {"chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability",
                  "chunked_attention_memory"}

MUTANTS = [
    Mutant("peak_reads_current_size", "measure_peak",
           "_, peak = tracemalloc.get_traced_memory()", "peak, _ = tracemalloc.get_traced_memory()",
           {"measure_peak_values"}, "take the PEAK"),
    Mutant("every_head_kept_alive", HBH,
           "        out += (S @ V) @ W_O[cols, :]",
           "        kept = locals().get(\"kept\", []) + [S]  # every head's weights, for plotting later\n"
           "        out += (S @ V) @ W_O[cols, :]",
           {"head_by_head_forward_memory"}, "more than one head's (B, L, L) scores are alive at once"),
    Mutant("full_score_tensor_built", HBH,
           "    for i in range(num_heads):",
           "    Q_all = (X @ W_Q).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)  # (B, h, L, d_k)\n"
           "    K_all = (X @ W_K).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)  # (B, h, L, d_k)\n"
           "    S_all = Q_all @ K_all.transpose(0, 1, 3, 2)  # (B, h, L, L): every head's scores at once\n"
           "    for i in range(num_heads):",
           {"head_by_head_forward_memory"}, "a full (B, h, L, L) score tensor"),
    Mutant("scale_by_sqrt_d_model", HBH,
           "scale = 1.0 / np.sqrt(d_k)", "scale = 1.0 / np.sqrt(d_model)",
           {"head_by_head_forward_values", "head_by_head_forward_mask", "head_by_head_forward_memory"},
           "scaled by sqrt(d_model)"),
    Mutant("no_rescale_of_accumulator", CHUNKED,
           "acc = alpha * acc + P @ V[:, :, ks:ke]", "acc = acc + P @ V[:, :, ks:ke]",
           CHUNKED_VALUES, "rescale the accumulator"),
    Mutant("running_max_not_updated", CHUNKED,
           "            m_i = m_new\n", "",
           CHUNKED_VALUES, "carry the running max m forward"),
    Mutant("diagonal_masked_too", CHUNKED,
           "np.arange(qs, qe)[:, None] < np.arange(ks, ke)[None, :]",
           "np.arange(qs, qe)[:, None] <= np.arange(ks, ke)[None, :]",
           {"chunked_attention_causal"}, "also hides the diagonal"),
    Mutant("exp_without_max", CHUNKED,
           "m_new = np.maximum(m_i, S.max(axis=-1, keepdims=True))", "m_new = np.zeros_like(m_i)",
           {"chunked_attention_stability"}, "subtract the running maximum"),
    Mutant("last_partial_block_dropped", CHUNKED,
           "n_blocks = -(-L // block_size)", "n_blocks = L // block_size",
           {"chunked_attention_values", "chunked_attention_causal"}, "partial block is skipped"),
    Mutant("answer_from_mha_lab", CHUNKED,
           "    B, h, L, d = Q.shape\n",
           "    from mha_lab.cpu import chunked_attention as fast\n"
           "    return fast(Q, K, V, causal=causal, block_q=block_size, block_k=block_size)\n"
           "    B, h, L, d = Q.shape\n",
           {"chunked_attention_shape"} | CHUNKED_VALUES, "uses mha_lab.cpu.chunked_attention"),
]
