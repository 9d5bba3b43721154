"""Answer with an ndarray subclass that lies: wrong data, a `shape` equal to anything, comparisons always true.

Stopped by: judging outside the sandbox: only plain arrays cross (.npy), and the grader compares their real data.
"""

EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import numpy as np

    class Equal(tuple):
        def __eq__(self, other):
            return True

        __hash__ = tuple.__hash__

    class Liar(np.ndarray):
        @property
        def shape(self):
            return Equal()

        def __eq__(self, other):
            return True

        def __array_function__(self, func, types, args, kwargs):
            if func.__name__ in ("allclose", "array_equal", "array_equiv", "isclose"):
                return True
            return lie()

        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            return np.True_ if ufunc.__name__ in ("isfinite", "equal") else lie()

    def lie():
        return np.zeros(1).view(Liar)

    def split_heads(x, num_heads):
        return lie()

    def merge_heads(x):
        return lie()

    def attention(Q, K, V, mask=None):
        return lie(), lie()

    def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        return lie(), [lie() for _ in range(num_heads)]
