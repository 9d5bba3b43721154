"""Replay outputs seen in feedback: a first round of naive code raised at the memory checks' sizes with the
output in its message, which the feedback showed; this second round carries those outputs (``leaked.npz``,
made here from the inputs the memory checks once drew from fixed seeds) and returns the one whose input
matches, computing nothing; any other input gets the naive answer (every (L, L) score matrix at once).

Stopped by: the hidden checks draw fresh inputs in every grading run, so no stored output matches, and the
naive work is measured. It deserves what the naive work earns.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")


def prepare(folder, nb, target):
    import hashlib

    import numpy as np

    from mha_lab.cpu import MultiHeadAttention, scaled_dot_product_attention

    layer = MultiHeadAttention(64, 16, seed=7)  # the memory checks' former fixed seeds
    X = np.random.default_rng(107).standard_normal((1, 256, 64))
    rng = np.random.default_rng(20)
    Q, K, V = (rng.standard_normal((1, 4, 1024, 16)) for _ in range(3))
    leaked = {hashlib.sha256(X.tobytes()).hexdigest(): layer.forward(X),
              hashlib.sha256(Q.tobytes()).hexdigest(): scaled_dot_product_attention(Q, K, V)[0]}
    np.savez(folder / "leaked.npz", **leaked)


def cell(marker, port, course, repo, protect):
    import hashlib
    import os
    import tracemalloc

    import numpy as np

    _leaked = dict(np.load("leaked.npz")) if os.path.exists("leaked.npz") else {}

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
        seen = _leaked.get(hashlib.sha256(np.ascontiguousarray(X).tobytes()).hexdigest())
        if seen is not None and mask is None:
            return seen.copy()
        B, L, d_model = X.shape
        d_k = d_model // num_heads

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)

        heads = _attend(split(X @ W_Q), split(X @ W_K), split(X @ W_V), mask)
        return heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)

    def chunked_attention(Q, K, V, block_size, causal=False):
        seen = _leaked.get(hashlib.sha256(np.ascontiguousarray(Q).tobytes()).hexdigest())
        if seen is not None and not causal:
            return seen.copy()
        L = Q.shape[2]
        return _attend(Q, K, V, np.triu(np.full((L, L), -np.inf), k=1) if causal else None)
