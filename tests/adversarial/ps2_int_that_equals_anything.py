"""Answer kv_cache_bytes with an int subclass that compares equal to every number, and the forwards with an
ndarray subclass whose comparisons always pass.

Stopped by: judging outside the sandbox: an int crosses as its value, an array as its data, and both are wrong.
"""

ASSIGNMENT = "ps2_mqa"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import numpy as np

    class Yes(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Agreeable(np.ndarray):
        def __eq__(self, other):
            return np.ones(np.shape(other), dtype=bool)

        def __array_function__(self, func, types, args, kwargs):
            return True

    def kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
        return Yes(7)

    def mqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        return np.zeros(3).view(Agreeable)

    def gqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads, mask=None):
        return np.zeros(3).view(Agreeable)
