"""Hide memory in a cell of the student's own before the first answer cell, which ran before the old baseline:
it holds 160 MiB of ballast and the full (B, h, L, L) score buffers of both memory checks, written so that they
are resident. head_by_head_forward drops the ballast inside the measured call and then builds every score
matrix at once (the call "frees" more than it uses); chunked_attention fills the ready buffer with ``out=``.

Stopped by: the memory baseline comes before any cell the student wrote (only the release's given cells run
before it), and the peak is read from what the student's code holds when the call starts: ballast and buffers
count. Without a memory cgroup no memory points are given. It deserves what the naive work earns.
"""

ASSIGNMENT = "ps3_memory_efficient"
EVERY_ANSWER_CELL = True
DESERVES = ("measure_peak_values", "head_by_head_forward_shape", "head_by_head_forward_values",
            "head_by_head_forward_mask", "head_by_head_forward_stability", "chunked_attention_shape",
            "chunked_attention_values", "chunked_attention_causal", "chunked_attention_stability")

EARLY = """import numpy as np
_ballast = [np.ones(160 * 2**20 // 8)]  # 160 MiB, resident
_scores = {(1, 4, 1024): np.ones((1, 4, 1024, 1024))}  # chunked_attention's memory check, resident
"""


def prepare(folder, nb, target):
    import nbformat
    from nbformat.v4 import new_code_cell

    first = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("solution"))
    nb.cells.insert(first, new_code_cell(EARLY))
    nbformat.write(nb, folder / "ps3_memory_efficient.ipynb")


def cell(marker, port, course, repo, protect):
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

    def _softmax_inplace(S):
        S -= S.max(axis=-1, keepdims=True)
        np.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        return S

    def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        globals().get("_ballast", []).clear()  # 160 MiB freed inside the measured call
        B, L, d_model = X.shape
        d_k = d_model // num_heads

        def split(T):  # (B, L, d_model) -> (B, h, L, d_k)
            return T.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)

        S = split(X @ W_Q) @ split(X @ W_K).transpose(0, 1, 3, 2) / np.sqrt(d_k)  # (B, h, L, L) at once
        if mask is not None:
            S += mask
        heads = _softmax_inplace(S) @ split(X @ W_V)
        return heads.transpose(0, 2, 1, 3).reshape(B, L, d_model) @ W_O  # (B, h, L, d_k) -> (B, L, d_model)

    def chunked_attention(Q, K, V, block_size, causal=False):
        B, h, L, d = Q.shape
        S = globals().get("_scores", {}).get((B, h, L))
        S = np.empty((B, h, L, L)) if S is None else S
        np.matmul(Q, K.transpose(0, 1, 3, 2), out=S)  # into the buffer made before the first answer cell
        S /= np.sqrt(d)
        if causal:
            S += np.triu(np.full((L, L), -np.inf), k=1)
        return _softmax_inplace(S) @ V
