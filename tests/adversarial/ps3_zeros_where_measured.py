"""Earn memory points for work not done: plain full-score attention that returns zeros where the memory cells
measure (np.zeros_like(Q) at L >= 512 in chunked_attention, np.zeros at L >= 128 head by head), and every value
checked at small L right.

Stopped by: a memory check compares the measured call's output with the reference at that size; a wrong result
earns no memory points. It deserves every point of its two functions but their memory cells.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def cell(marker, port, course, repo, protect):
    import numpy as np

    def _full(Q, K, V, mask=None):
        S = Q @ K.swapaxes(-1, -2) / np.sqrt(Q.shape[-1])
        if mask is not None:
            S = S + mask
        P = np.exp(S - S.max(axis=-1, keepdims=True))
        return (P / P.sum(axis=-1, keepdims=True)) @ V

    def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        B, L, d_model = X.shape
        if L >= 128:
            return np.zeros((B, L, W_O.shape[1]))
        d_k = d_model // num_heads

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)

        heads = _full(split(X @ W_Q), split(X @ W_K), split(X @ W_V), mask)
        return heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O

    def chunked_attention(Q, K, V, block_size, causal=False):
        L = Q.shape[2]
        if L >= 512:
            return np.zeros_like(Q)
        return _full(Q, K, V, np.triu(np.full((L, L), -np.inf), k=1) if causal else None)
