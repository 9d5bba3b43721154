"""One-bug variants of the ps1_per_head_loop solution, each with the tests cells it must fail;
and correct solutions written differently, which must keep every point.

The loop's cells are judged with mha_lab's attention in place of the student's, so a bug in
``attention`` costs only the attention cells.
"""

from tests.mutants import NOT_AVAILABLE, Mutant, Variant

SPLIT = "x.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)"

MUTANTS = [
    Mutant("split: reshape without transpose", "ans_split_heads", SPLIT, "x.reshape(B, num_heads, L, d_k)",
           breaks={"split_heads_values"}, feedback="reshape without transposing"),
    Mutant("split: transpose before reshape", "ans_split_heads", SPLIT,
           "x.transpose(0, 2, 1).reshape(B, num_heads, L, d_k)",
           breaks={"split_heads_values"}, feedback="transpose before reshaping"),
    Mutant("merge: reshape without transpose", "ans_merge_heads",
           "x.transpose(0, 2, 1, 3).reshape(B, L, h * d_k)", "x.reshape(B, L, h * d_k)",
           breaks={"merge_heads_values"}, feedback="reshape without transposing"),
    Mutant("attention: scale by 1/d_k", "ans_attention", "/ np.sqrt(d_k)", "/ d_k",
           breaks={"attention_values", "attention_mask"}, feedback="1/sqrt(d_k)", bug="scale-not-sqrt-d-k"),
    Mutant("attention: inverted mask", "ans_attention", "scores = scores + mask",
           "scores = np.where(mask == 0, -np.inf, scores)",
           breaks={"attention_mask"}, feedback="mask inverted"),
    Mutant("attention: softmax without the max", "ans_attention",
           "scores = scores - scores.max(axis=-1, keepdims=True)  # the largest exponent is 0: no overflow",
           "pass",
           breaks={"attention_stability"}, feedback="row maximum"),
    Mutant("loop: scores scaled by sqrt(d_model), as in the paper", "ans_mha_forward_loop",
           "Q, K, V = X @ W_Q[:, cols], X @ W_K[:, cols]",
           "Q, K, V = X @ W_Q[:, cols] * np.sqrt(d_k / X.shape[-1]), X @ W_K[:, cols]",
           breaks={"mha_loop_values", "mha_loop_mask", "mha_loop_weights"}, feedback="divided by sqrt(d_model)",
           bug="scale-d-model"),
    Mutant("loop: W_O sliced by columns", "ans_mha_forward_loop", "W_O[cols, :]", "W_O[:, cols].T",
           breaks={"mha_loop_values", "mha_loop_mask"}, feedback="rows i*d_k:(i+1)*d_k"),
    Mutant("loop: weights stacked along the batch axis", "ans_mha_forward_loop", "return out, head_weights",
           "return out, np.stack(head_weights, axis=1)",
           breaks={"mha_loop_weights"}, feedback="not one array stacked along another axis"),
    Mutant("loop: answer taken from mha_lab", "ans_mha_forward_loop", "    return out, head_weights",
           "    from mha_lab.cpu import per_head_attention, MultiHeadAttention\n"
           "    layer = MultiHeadAttention(X.shape[-1], num_heads)\n"
           "    layer.W_Q, layer.W_K, layer.W_V, layer.W_O = W_Q, W_K, W_V, W_O\n"
           "    return per_head_attention(X, layer, mask)",
           breaks={"mha_loop_shape", "mha_loop_values", "mha_loop_mask", "mha_loop_weights"},
           feedback=NOT_AVAILABLE),
]

# --- correct solutions written differently ------------------------------------------------------

SPLIT_STACK = '''def split_heads(x, num_heads):
    """(B, L, d_model) -> (B, h, L, d_k): cut the features into h chunks, stack them on a new axis 1."""
    return np.stack(np.split(x, num_heads, axis=-1), axis=1)
'''

MERGE_CONCAT = '''def merge_heads(x):
    """(B, h, L, d_k) -> (B, L, h * d_k): put the heads side by side again."""
    return np.concatenate([x[:, i] for i in range(x.shape[1])], axis=-1)
'''

ATTENTION_EINSUM = '''def attention(Q, K, V, mask=None):
    """einsum, and a log-sum-exp softmax."""
    scores = np.einsum("bqd,bkd->bqk", Q, K) / Q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores + mask
    m = scores.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(scores - m).sum(axis=-1, keepdims=True))
    weights = np.exp(scores - lse)
    return np.einsum("bqk,bkv->bqv", weights, V), weights
'''

LOOP_EINSUM = '''def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Heads from split weight matrices, projected with einsum."""
    W_Qs = np.split(W_Q, num_heads, axis=1)  # h blocks of columns
    W_Ks = np.split(W_K, num_heads, axis=1)
    W_Vs = np.split(W_V, num_heads, axis=1)
    W_Os = np.split(W_O, num_heads, axis=0)  # h blocks of rows
    outs, weights = [], []
    for wq, wk, wv, wo in zip(W_Qs, W_Ks, W_Vs, W_Os):
        head, w = attention(np.einsum("bld,dk->blk", X, wq), np.einsum("bld,dk->blk", X, wk),
                            np.einsum("bld,dk->blk", X, wv), mask)
        outs.append(np.einsum("blk,kd->bld", head, wo))
        weights.append(w)
    return sum(outs), weights
'''

SPLIT_SWAPAXES = '''def split_heads(x, num_heads):
    B, L, d_model = x.shape
    return x.reshape(B, L, num_heads, -1).swapaxes(1, 2)
'''

MERGE_MOVEAXIS = '''def merge_heads(x):
    B, h, L, d_k = x.shape
    return np.moveaxis(x, 1, 2).reshape(B, L, -1)
'''

ATTENTION_IN_PLACE = '''def attention(Q, K, V, mask=None):
    """In-place softmax on one scores buffer."""
    scores = np.matmul(Q, np.swapaxes(K, -1, -2))
    scores /= np.sqrt(Q.shape[-1])
    if mask is not None:
        scores += mask
    scores -= np.max(scores, axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= np.sum(scores, axis=-1, keepdims=True)
    return np.matmul(scores, V), scores
'''

LOOP_CONCAT = '''def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Concatenate the heads' outputs, then one product with the whole W_O."""
    d_k = W_Q.shape[1] // num_heads
    heads, head_weights = [], []
    for i in range(num_heads):
        c = slice(i * d_k, (i + 1) * d_k)
        head, w = attention(X @ W_Q[:, c], X @ W_K[:, c], X @ W_V[:, c], mask=mask)
        heads.append(head)
        head_weights.append(w)
    return np.concatenate(heads, axis=-1) @ W_O, head_weights
'''

SPLIT_LOOP = '''def split_heads(x, num_heads):
    B, L, d_model = x.shape
    d_k = d_model // num_heads
    out = np.empty((B, num_heads, L, d_k), dtype=x.dtype)
    for i in range(num_heads):
        out[:, i] = x[:, :, i * d_k:(i + 1) * d_k]
    return out
'''

MERGE_LOOP = '''def merge_heads(x):
    B, h, L, d_k = x.shape
    out = np.empty((B, L, h * d_k), dtype=x.dtype)
    for i in range(h):
        out[:, :, i * d_k:(i + 1) * d_k] = x[:, i]
    return out
'''

ATTENTION_PER_SEQUENCE = '''def attention(Q, K, V, mask=None):
    """One sequence at a time, 2-D products."""
    scale = 1 / np.sqrt(K.shape[-1])
    mask = np.zeros((Q.shape[0], Q.shape[1], K.shape[1])) + (0.0 if mask is None else mask)
    outs, weights = [], []
    for q, k, v, m in zip(Q, K, V, mask):
        s = q @ k.T * scale + m
        e = np.exp(s - s.max(axis=1, keepdims=True))
        w = e / e.sum(axis=1, keepdims=True)
        outs.append(w @ v)
        weights.append(w)
    return np.array(outs), np.array(weights)
'''

LOOP_REVERSED = '''def mha_forward_loop(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Heads visited last to first; the list of weights is put back in head order."""
    d_k = X.shape[-1] // num_heads
    out = np.zeros_like(X @ W_O)
    head_weights = [None] * num_heads
    for i in reversed(range(num_heads)):
        r = np.arange(i * d_k, (i + 1) * d_k)
        head, head_weights[i] = attention(X @ W_Q[:, r], X @ W_K[:, r], X @ W_V[:, r], mask)
        out += head @ W_O[r]
    return out, head_weights
'''

VARIANTS = [
    Variant("split/stack, concatenate, einsum, log-sum-exp",
            {"ans_split_heads": SPLIT_STACK, "ans_merge_heads": MERGE_CONCAT, "ans_attention": ATTENTION_EINSUM,
             "ans_mha_forward_loop": LOOP_EINSUM}),
    Variant("swapaxes/moveaxis, in-place softmax, heads concatenated",
            {"ans_split_heads": SPLIT_SWAPAXES, "ans_merge_heads": MERGE_MOVEAXIS, "ans_attention": ATTENTION_IN_PLACE,
             "ans_mha_forward_loop": LOOP_CONCAT}),
    Variant("explicit loops over heads and sequences, heads in reverse",
            {"ans_split_heads": SPLIT_LOOP, "ans_merge_heads": MERGE_LOOP, "ans_attention": ATTENTION_PER_SEQUENCE,
             "ans_mha_forward_loop": LOOP_REVERSED}),
]

# --- bugs that show only for a batch above 1: each must fail a visible test (``breaks``) of the release ---

BATCH_MUTANTS = [
    Mutant("split_heads: one sequence only", "ans_split_heads",
           "return x.reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)",
           "return x.reshape(L, num_heads, d_k).transpose(1, 0, 2)[None]",
           {"split_heads_shape", "split_heads_values"}, "batch"),
    Mutant("merge_heads: the first sequence only", "ans_merge_heads",
           "return x.transpose(0, 2, 1, 3).reshape(B, L, h * d_k)",
           "return x[:1].transpose(0, 2, 1, 3).reshape(1, L, h * d_k)",
           {"merge_heads_values"}, "batch"),
    Mutant("attention: every sequence reads the first one's keys", "ans_attention",
           "scores = Q @ K.swapaxes(-1, -2) / np.sqrt(d_k)", "scores = Q @ K[0].T / np.sqrt(d_k)",
           {"attention_values", "mha_loop_values", "mha_loop_mask"}, "batch"),  # the visible loop calls it too
    Mutant("mha_forward_loop: weights of the first sequence only", "ans_mha_forward_loop",
           "head_weights.append(weights)", "head_weights.append(weights[:1])",
           {"mha_loop_weights"}, "batch"),
]
