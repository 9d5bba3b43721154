"""During ``mha_forward_loop``, ask the grader's reference ``attention`` (the stand-in the loop is judged with) to
attend over L = 16,384: its (L, L) weights would take 2 GiB in the grader's own process, outside the sandbox's
caps. Then compute the loop honestly.

Stopped by: the reference answers only near the sizes of the call it was given to (at most 16 times its
elements, 4 times its longest axis, or 64); the refused call raises in the student's code, the grader's memory
stays flat, and the honest loop keeps its points.
"""

ASSIGNMENT = "ps1_per_head_loop"
EVERY_ANSWER_CELL = True
DESERVES = ("split_heads_shape", "split_heads_values", "merge_heads_values", "attention_values", "attention_mask",
            "attention_stability", "mha_loop_shape", "mha_loop_values", "mha_loop_mask", "mha_loop_weights")


def cell(marker, port, course, repo, protect):
    import numpy as np

    def split_heads(x, num_heads):
        B, L, d_model = x.shape
        return x.reshape(B, L, num_heads, d_model // num_heads).transpose(0, 2, 1, 3)

    def merge_heads(x):
        B, h, L, d_k = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, L, h * d_k)

    def attention(Q, K, V, mask=None):
        scores = Q @ K.swapaxes(-1, -2) / np.sqrt(Q.shape[-1])
        if mask is not None:
            scores = scores + mask
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        return weights @ V, weights

    def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
        huge = np.ones((1, 16384, 1))
        try:  # in the grader's process: 16,384 x 16,384 float64 weights, twice over
            attention(huge, huge, huge)
        except Exception:  # noqa: BLE001 - refused: go on honestly
            pass
        d_k = X.shape[-1] // num_heads
        out, head_weights = np.zeros(X.shape[:-1] + (W_O.shape[1],)), []
        for i in range(num_heads):
            cols = slice(i * d_k, (i + 1) * d_k)
            head, weights = attention(X @ W_Q[:, cols], X @ W_K[:, cols], X @ W_V[:, cols], mask)
            out = out + head @ W_O[cols, :]
            head_weights.append(weights)
        return out, head_weights
