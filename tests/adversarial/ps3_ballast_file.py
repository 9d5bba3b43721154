"""Hide memory in a file of the submission folder: a 160 MiB file, which the worker once copied into the
sandbox's tmpfs before the baseline; the naive answers (every (L, L) score matrix at once) delete it inside
the measured call, so that the call "frees" more than it uses.

Stopped by: the submission's files are copied after the memory baseline and count as the student's, and the
peak is read from what the sandbox holds when the call starts. Without a memory cgroup no memory points are
given. It deserves what the naive work earns.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def prepare(folder, nb, target):
    with open(folder / "ballast.bin", "wb") as f:
        for _ in range(160):
            f.write(b"\x5a" * 2**20)


def cell(marker, port, course, repo, protect):
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

    def _attend(Q, K, V, mask=None):  # (B, h, L, d) each; every (L, L) score matrix at once
        if os.path.exists("ballast.bin"):
            os.remove("ballast.bin")  # 160 MiB of tmpfs freed inside the measured call
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
        return heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)

    def chunked_attention(Q, K, V, block_size, causal=False):
        L = Q.shape[2]
        return _attend(Q, K, V, np.triu(np.full((L, L), -np.inf), k=1) if causal else None)
