"""Forge the memory measurement with a buffer kept between calls: chunked_attention builds the full (B, h, L, L)
score matrix in a module-level buffer, allocated when a call first needs it and reused ("preallocate for speed"),
so a measured call that follows another on the same shapes allocates nothing new. Its values are right.

Stopped by: a measured call runs in a fresh sandbox that has only defined the functions, its peak counted from
before the answer cells ran: the buffer is allocated inside the measurement. It deserves chunked_attention's
points but its memory's.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("chunked_attention_shape", "chunked_attention_values", "chunked_attention_causal",
            "chunked_attention_stability")


def cell(marker, port, course, repo, protect):
    import numpy as np

    _buffer = {}

    def chunked_attention(Q, K, V, block_size, causal=False):
        B, h, L, d = Q.shape
        if _buffer.get("S") is None or _buffer["S"].shape != (B, h, L, L):
            _buffer["S"] = np.empty((B, h, L, L))  # allocated once, reused by every later call of this shape
        S = _buffer["S"]
        np.matmul(Q, K.transpose(0, 1, 3, 2), out=S)
        S /= np.sqrt(d)
        if causal:
            S[..., np.triu_indices(L, k=1)[0], np.triu_indices(L, k=1)[1]] = -np.inf
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        return S @ V
