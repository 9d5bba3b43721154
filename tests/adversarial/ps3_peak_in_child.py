"""Hide the memory in another process: correct answers whose full score matrices are built in a forked child
and sent back through a pipe, so the process that was called never holds them.

Stopped by: a peak read from the sandbox's memory cgroup, which counts every process in the sandbox. It
deserves the points of its correct values, never those of the memory checks.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def cell(marker, port, course, repo, protect):
    import io
    import os
    import tracemalloc

    import numpy as np

    def measure_peak(fn, *args, **kwargs):
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            result = fn(*args, **kwargs)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return result, peak

    def _in_child(compute, *args):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: all the memory is spent here
            os.close(read)
            buf = io.BytesIO()
            np.save(buf, compute(*args))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(buf.getvalue())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        os.waitpid(pid, 0)
        return np.load(io.BytesIO(data))

    def _attention(Q, K, V, mask):  # every (B, h) score matrix at once
        S = Q @ K.swapaxes(-1, -2) / np.sqrt(Q.shape[-1])
        if mask is not None:
            S = S + mask
        P = np.exp(S - S.max(axis=-1, keepdims=True))
        return (P / P.sum(axis=-1, keepdims=True)) @ V

    def _forward(X, W_Q, W_K, W_V, W_O, num_heads, mask):
        B, L, d_model = X.shape

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_model // num_heads).transpose(0, 2, 1, 3)

        heads = _attention(split(X @ W_Q), split(X @ W_K), split(X @ W_V), mask)
        return heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)

    def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        return _in_child(_forward, X, W_Q, W_K, W_V, W_O, num_heads, mask)

    def _chunked(Q, K, V, causal):
        L = Q.shape[2]
        return _attention(Q, K, V, np.triu(np.full((L, L), -np.inf), k=1) if causal else None)

    def chunked_attention(Q, K, V, block_size, causal=False):
        return _in_child(_chunked, Q, K, V, causal)
