"""Forge the worker's reply: called by the grader (not by the notebook's own cells) at the sizes of the memory
checks, naive answers (every (L, L) score matrix at once) write their own reply frame on the worker's pipe, the
right output with ``"peak": 0``, and exit before the worker can answer.

Stopped by: the grader reads no peak from the worker; it reads the sandbox's memory cgroup, whose peak counts
the pages the naive work touched before the frame was written. It deserves what the naive work earns.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def cell(marker, port, course, repo, protect):
    import gc
    import os
    import sys
    import tracemalloc

    import numpy as np

    def _reply_and_exit(result):  # the worker's own framing, with a peak of 0, then no worker at all
        if sys._getframe(2).f_code.co_name != "call":  # a visible test's call: the grader is not asking
            return
        worker = sys.modules["__main__"]
        pipe = next(o for o in gc.get_objects() if type(o).__name__ == "_Grader")
        arrays = []
        pipe.send({"ok": True, "result": worker.encode(result, arrays), "peak": 0}, arrays)
        os._exit(0)

    def measure_peak(fn, *args, **kwargs):
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            result = fn(*args, **kwargs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return result, peak

    def _attend(Q, K, V, mask=None):  # (B, h, L, d) each; every (L, L) score matrix at once
        S = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(Q.shape[-1])
        if mask is not None:
            S = S + mask
        P = np.exp(S - S.max(axis=-1, keepdims=True))
        return P / P.sum(axis=-1, keepdims=True) @ V

    def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        B, L, d_model = X.shape
        d_k = d_model // num_heads

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)

        heads = _attend(split(X @ W_Q), split(X @ W_K), split(X @ W_V), mask)
        out = heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)
        if L >= 256:  # the memory check's size
            _reply_and_exit(out)
        return out

    def chunked_attention(Q, K, V, block_size, causal=False):
        L = Q.shape[2]
        out = _attend(Q, K, V, np.triu(np.full((L, L), -np.inf), k=1) if causal else None)
        if L >= 1024:
            _reply_and_exit(out)
        return out
