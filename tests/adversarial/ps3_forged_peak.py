"""Forge the memory measurement: correct but memory-hungry answers (the fused layer, the full score matrix)
that reset tracemalloc's peak before they return, and a tracemalloc.get_traced_memory that reports no growth
whenever mha_lab's grading code asks.

Stopped by: a measurement the submission's code cannot reach. It deserves the points of its correct values,
never those of the memory checks.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def cell(marker, port, course, repo, protect):
    import _tracemalloc
    import sys
    import tracemalloc

    import numpy as np

    if not hasattr(tracemalloc, "_honest"):
        tracemalloc._honest = tracemalloc.get_traced_memory

        def _traced():
            current, peak = tracemalloc._honest()
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return (current, current) if caller.startswith("mha_lab") else (current, peak)

        tracemalloc.get_traced_memory = _traced

    def measure_peak(fn, *args, **kwargs):
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            result = fn(*args, **kwargs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return result, peak

    def _softmax(S):
        S = S - S.max(axis=-1, keepdims=True)
        P = np.exp(S)
        return P / P.sum(axis=-1, keepdims=True)

    def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        B, L, d_model = X.shape
        d_k = d_model // num_heads

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)

        S = split(X @ W_Q) @ split(X @ W_K).transpose(0, 1, 3, 2) / np.sqrt(d_k)  # every head's (L, L) at once
        if mask is not None:
            S = S + mask
        heads = _softmax(S) @ split(X @ W_V)
        out = heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)
        del S, heads
        _tracemalloc.reset_peak()  # the peak is now what is alive: the output
        return out

    def chunked_attention(Q, K, V, block_size, causal=False):
        L = Q.shape[2]
        S = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(Q.shape[-1])  # the full (B, h, L, L) score matrix
        if causal:
            S = S + np.triu(np.full((L, L), -np.inf), k=1)
        out = _softmax(S) @ V
        del S
        _tracemalloc.reset_peak()
        return out
