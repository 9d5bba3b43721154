"""Forge the memory measurement from inside the student's process, as a host without a memory cgroup once
allowed: naive answers that build every (L, L) score matrix at once; head_by_head_forward stops tracemalloc
before it returns and patches the worker's reply function (``__main__._answer``) to report a peak of 0;
chunked_attention holds its scores in an anonymous mmap, which tracemalloc does not trace.

Stopped by: no measurement in the student's process at all. With a memory cgroup the kernel counts every page
(mapped, traced or not); without one no memory points are given ("memory not measured on this host"). It
deserves what the naive work earns: every cell but memory.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def cell(marker, port, course, repo, protect):
    import mmap
    import sys
    import tracemalloc

    import numpy as np

    _main = sys.modules["__main__"]
    if callable(getattr(_main, "_answer", None)) and not hasattr(_main, "_honest_answer"):
        _main._honest_answer = _main._answer

        def _answer(*args, **kwargs):  # every reply says the call used nothing
            reply, arrays = _main._honest_answer(*args, **kwargs)
            reply["peak"] = 0
            return reply, arrays

        _main._answer = _answer

    def measure_peak(fn, *args, **kwargs):
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            result = fn(*args, **kwargs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return result, peak

    def _softmax_inplace(S):
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        return S

    def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        B, L, d_model = X.shape
        d_k = d_model // num_heads

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)

        S = split(X @ W_Q) @ split(X @ W_K).transpose(0, 1, 3, 2) / np.sqrt(d_k)  # (B, h, L, L) at once
        if mask is not None:
            S += mask
        heads = _softmax_inplace(S) @ split(X @ W_V)
        out = heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)
        tracemalloc.stop()  # whatever traced the call now reads nothing
        return out

    def chunked_attention(Q, K, V, block_size, causal=False):
        B, h, L, d = Q.shape
        held = mmap.mmap(-1, B * h * L * L * 8)  # anonymous pages: not Python allocations
        S = np.frombuffer(held, dtype=np.float64).reshape(B, h, L, L)
        np.matmul(Q, K.transpose(0, 1, 3, 2), out=S)
        S /= np.sqrt(d)
        if causal:
            S += np.triu(np.full((L, L), -np.inf), k=1)
        return _softmax_inplace(S) @ V
