"""One-bug variants of the ps2_mqa solution, each with the tests cells it must fail;
and correct solutions written differently, which must keep every point."""

from tests.mutants import NOT_AVAILABLE, Mutant, Variant

DECODE = "ans_decode_step"

MUTANTS = [
    Mutant("mqa: scale by sqrt(d_model)", "ans_mqa_forward", "/ np.sqrt(d_k)", "/ np.sqrt(d_model)",
           breaks={"mqa_forward_values", "mqa_forward_mask"}, feedback="not by 1/sqrt(d_model)", bug="scale-d-model"),
    Mutant("mqa: inverted mask", "ans_mqa_forward", "scores = scores + mask",
           "scores = np.where(mask == 0, -np.inf, scores)",
           breaks={"mqa_forward_mask"}, feedback="inverted"),
    Mutant("mqa: query heads reshaped without transpose", "ans_mqa_forward",
           "(X @ W_Q).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)",
           "(X @ W_Q).reshape(B, num_heads, L, d_k)",
           breaks={"mqa_forward_values", "mqa_forward_mask"}, feedback="reshape without transposing"),
    Mutant("mqa: answer taken from mha_lab", "ans_mqa_forward", "    B, L, d_model = X.shape\n",
           "    from mha_lab.cpu import GroupedQueryAttention\n"
           "    layer = GroupedQueryAttention(X.shape[-1], num_heads, 1)\n"
           "    layer.W_Q, layer.W_K, layer.W_V, layer.W_O = W_Q, W_K, W_V, W_O\n"
           "    return layer.forward(X, mask)\n",
           breaks={"mqa_forward_shape", "mqa_forward_values", "mqa_forward_mask"},
           feedback=NOT_AVAILABLE),
    Mutant("gqa: np.tile instead of np.repeat", "ans_gqa_forward",
           "np.repeat(K, n_rep, axis=1), np.repeat(V, n_rep, axis=1)",
           "np.tile(K, (1, n_rep, 1, 1)), np.tile(V, (1, n_rep, 1, 1))",
           breaks={"gqa_forward_values"}, feedback="repeat_interleave", bug="tile-not-repeat"),
    Mutant("gqa: heads merged without transpose", "ans_gqa_forward",
           "Z.transpose(0, 2, 1, 3).reshape(B, L, d_model)", "Z.reshape(B, L, d_model)",
           breaks={"gqa_forward_values", "gqa_forward_limits"}, feedback="reshape without transposing"),
    Mutant("gqa: scale by sqrt(d_model)", "ans_gqa_forward", "/ np.sqrt(d_k)", "/ np.sqrt(d_model)",
           breaks={"gqa_forward_values", "gqa_forward_limits"}, feedback="not by 1/sqrt(d_model)",
           bug="scale-d-model"),
    Mutant("kv cache: no factor 2", "ans_kv_cache_bytes", "return 2 * n_layers", "return n_layers",
           breaks={"kv_cache_bytes_values"}, feedback="forget the factor of 2"),
    Mutant("kv cache: answer taken from mha_lab", "ans_kv_cache_bytes", "    return 2 * n_layers",
           "    from mha_lab.analysis import ModelConfig, kv_cache_bytes as reference\n"
           "    config = ModelConfig('any', n_layers, n_kv_heads * head_dim, n_kv_heads, n_kv_heads, head_dim)\n"
           "    dtype = {1: 'int8', 2: 'float16', 4: 'float32', 8: 'float64'}[bytes_per_element]\n"
           "    return reference(config, seq_len, batch_size, dtype)\n    return 2 * n_layers",
           breaks={"kv_cache_bytes_values"}, feedback=NOT_AVAILABLE),
    Mutant("kv cache: batch size left out", "ans_kv_cache_bytes", " * batch_size", "",
           breaks={"kv_cache_bytes_values"}, feedback="2 (K and V) x n_layers"),
    Mutant("decode: key appended to the value cache", DECODE,
           "cache_v = np.concatenate([cache_v, v], axis=2)", "cache_v = np.concatenate([cache_v, k], axis=2)",
           breaks={"decode_step_cache", "decode_step_values", "decode_step_sequence"},
           feedback="the value cache got the new token's key"),
    Mutant("decode: the new token as the first row of the causal mask", DECODE,
           "    # the new token is the last row of the causal mask: it sees every cached token and itself\n",
           "    scores = scores + create_causal_mask(scores.shape[-1])[:, :, :1]  # the new token's row of the mask\n",
           breaks={"decode_step_values", "decode_step_sequence"}, feedback="the FIRST row of the mask"),
    Mutant("decode: attends before appending itself", DECODE,
           "    K, V = np.repeat(cache_k, n_rep, axis=1), np.repeat(cache_v, n_rep, axis=1)  # (B, h, T + 1, d_k)\n",
           "    K, V = np.repeat(cache_k[:, :, :-1], n_rep, axis=1), np.repeat(cache_v[:, :, :-1], n_rep, axis=1)\n",
           breaks={"decode_step_cache", "decode_step_values", "decode_step_sequence"},  # T = 0: nothing to see
           feedback="the new token must see itself"),
    Mutant("decode: np.tile instead of np.repeat", DECODE,
           "np.repeat(cache_k, n_rep, axis=1), np.repeat(cache_v, n_rep, axis=1)",
           "np.tile(cache_k, (1, n_rep, 1, 1)), np.tile(cache_v, (1, n_rep, 1, 1))",
           breaks={"decode_step_values", "decode_step_sequence"}, feedback="repeat_interleave", bug="tile-not-repeat"),
    Mutant("decode: scale by sqrt(d_model)", DECODE, "/ np.sqrt(d_k)", "/ np.sqrt(d_model)",
           breaks={"decode_step_values", "decode_step_sequence"}, feedback="not by 1/sqrt(d_model)",
           bug="scale-d-model"),
    Mutant("decode: caches the repeated heads", DECODE,
           "    return out, cache_k, cache_v", "    return out, K, V",
           breaks={"decode_step_cache", "decode_step_sequence"}, feedback="not the h repeated ones"),
    Mutant("decode: answer taken from mha_lab", DECODE, "    B, _, d_model = x.shape\n",
           "    from mha_lab.cpu import GroupedQueryAttention, KVCache\n"
           "    from mha_lab.cpu import decode_step as step\n"
           "    layer = GroupedQueryAttention(x.shape[-1], num_heads, num_kv_heads)\n"
           "    layer.W_Q, layer.W_K, layer.W_V, layer.W_O = W_Q, W_K, W_V, W_O\n"
           "    cache = KVCache(x.shape[0], num_kv_heads, x.shape[-1] // num_heads, max_len=cache_k.shape[2] + 1)\n"
           "    cache.append(cache_k, cache_v)\n"
           "    out = step(layer, x, cache)\n"
           "    return out, cache.keys.copy(), cache.values.copy()\n"
           "    B, _, d_model = x.shape\n",
           breaks={"decode_step_cache", "decode_step_values", "decode_step_sequence"},
           feedback=NOT_AVAILABLE),
]

# --- correct solutions written differently ------------------------------------------------------

MQA_EINSUM = '''def mqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """einsum; the single key/value head is never given a head axis."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    Q = np.einsum("bld,dhk->bhlk", X, W_Q.reshape(d_model, num_heads, d_k))  # (B, h, L, d_k)
    K, V = X @ W_K, X @ W_V  # (B, L, d_k)
    scores = np.einsum("bhqk,bsk->bhqs", Q, K) / np.sqrt(d_k)
    if mask is not None:
        scores = scores + mask
    Z = np.einsum("bhqs,bsk->bqhk", softmax(scores), V)  # (B, L, h, d_k)
    return np.einsum("bqhk,hkm->bqm", Z, W_O.reshape(num_heads, d_k, d_model))
'''

GQA_GROUPED = '''def gqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads, mask=None):
    """Queries grouped as (B, g, n_rep, L, d_k): each key/value head meets its group, nothing is repeated."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    n_rep = num_heads // num_kv_heads
    Q = (X @ W_Q).reshape(B, L, num_kv_heads, n_rep, d_k).transpose(0, 2, 3, 1, 4)  # (B, g, n_rep, L, d_k)
    K = (X @ W_K).reshape(B, L, num_kv_heads, d_k).transpose(0, 2, 1, 3)  # (B, g, L, d_k)
    V = (X @ W_V).reshape(B, L, num_kv_heads, d_k).transpose(0, 2, 1, 3)
    scores = np.einsum("bgrqd,bgsd->bgrqs", Q, K) / np.sqrt(d_k)  # (B, g, n_rep, L, L)
    if mask is not None:  # (B, h, L, L) -> (B, g, n_rep, L, L)
        scores = scores + np.broadcast_to(mask, (B, num_heads, L, L)).reshape(scores.shape)
    Z = np.einsum("bgrqs,bgsd->bqgrd", softmax(scores), V)  # (B, L, g, n_rep, d_k): query head g*n_rep + r
    return Z.reshape(B, L, d_model) @ W_O
'''

KV_PROD = '''import math


def kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    """K and V: two tensors of (n_layers, batch_size, n_kv_heads, seq_len, head_dim) elements."""
    return math.prod((2, n_layers, batch_size, n_kv_heads, seq_len, head_dim, bytes_per_element))
'''

DECODE_EINSUM = '''def decode_step(x, cache_k, cache_v, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads):
    """Grouped einsum against the cache; nothing is repeated."""
    B, _, d_model = x.shape
    d_k = d_model // num_heads
    g, r = num_kv_heads, num_heads // num_kv_heads
    q = (x[:, 0] @ W_Q).reshape(B, g, r, d_k)  # query head j*r + i is (j, i)
    k = (x[:, 0] @ W_K).reshape(B, g, 1, d_k)
    v = (x[:, 0] @ W_V).reshape(B, g, 1, d_k)
    cache_k = np.append(cache_k, k, axis=2)
    cache_v = np.append(cache_v, v, axis=2)
    scores = np.einsum("bgrd,bgtd->bgrt", q, cache_k) / np.sqrt(d_k)
    z = np.einsum("bgrt,bgtd->bgrd", softmax(scores), cache_v)  # (B, g, r, d_k)
    return z.reshape(B, 1, d_model) @ W_O, cache_k, cache_v
'''

MQA_HEAD_LOOP = '''def mqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """A loop over query heads, all reading the one key/value head."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    K, V = X @ W_K, X @ W_V  # (B, L, d_k), shared
    masks = np.broadcast_to(0.0 if mask is None else mask, (B, num_heads, L, L))
    heads = [softmax(X @ W_Q[:, i * d_k:(i + 1) * d_k] @ K.swapaxes(1, 2) / np.sqrt(d_k) + masks[:, i]) @ V
             for i in range(num_heads)]
    return np.concatenate(heads, axis=-1) @ W_O
'''

GQA_HEAD_LOOP = '''def gqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads, mask=None):
    """A loop over query heads; head i reads key/value head i // n_rep."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    n_rep = num_heads // num_kv_heads
    K_all, V_all = X @ W_K, X @ W_V  # (B, L, g * d_k)
    out = np.zeros((B, L, d_model))
    for i in range(num_heads):
        j = i // n_rep
        q = X @ W_Q[:, i * d_k:(i + 1) * d_k]
        k, v = K_all[..., j * d_k:(j + 1) * d_k], V_all[..., j * d_k:(j + 1) * d_k]
        s = q @ k.swapaxes(1, 2) / np.sqrt(d_k)  # (B, L, L)
        if mask is not None:
            s = s + np.broadcast_to(mask, (B, num_heads, L, L))[:, i]
        out += softmax(s) @ v @ W_O[i * d_k:(i + 1) * d_k]
    return out
'''

KV_LOOP = '''def kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    """Per token of one sequence first, then scaled up."""
    per_token = 0
    for _ in range(n_layers):
        per_token += 2 * n_kv_heads * head_dim * bytes_per_element  # one key and one value per head
    return per_token * seq_len * batch_size
'''

DECODE_PREALLOCATED = '''def decode_step(x, cache_k, cache_v, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads):
    """New cache arrays filled in place; a loop over query heads."""
    B, T = cache_k.shape[0], cache_k.shape[2]
    d_model = x.shape[-1]
    d_k = d_model // num_heads
    new_k = np.empty((B, num_kv_heads, T + 1, d_k))
    new_v = np.empty_like(new_k)
    new_k[:, :, :T], new_v[:, :, :T] = cache_k, cache_v
    new_k[:, :, T] = (x[:, 0] @ W_K).reshape(B, num_kv_heads, d_k)
    new_v[:, :, T] = (x[:, 0] @ W_V).reshape(B, num_kv_heads, d_k)
    q = (x[:, 0] @ W_Q).reshape(B, num_heads, d_k)
    heads = []
    for i in range(num_heads):
        j = i * num_kv_heads // num_heads  # its key/value head
        s = np.einsum("bd,btd->bt", q[:, i], new_k[:, j]) / np.sqrt(d_k)
        heads.append(np.einsum("bt,btd->bd", softmax(s), new_v[:, j]))
    return (np.concatenate(heads, axis=-1) @ W_O)[:, None], new_k, new_v
'''

MQA_SWAPAXES = '''def mqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    Q = np.swapaxes((X @ W_Q).reshape(B, L, num_heads, d_k), 1, 2)  # (B, h, L, d_k)
    K = np.expand_dims(X @ W_K, 1)  # (B, 1, L, d_k)
    V = np.expand_dims(X @ W_V, 1)
    s = np.matmul(Q, np.swapaxes(K, -1, -2)) * d_k ** -0.5
    if mask is not None:
        s += mask
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.moveaxis(p @ V, 1, 2).reshape(B, L, d_model) @ W_O
'''

GQA_TAKE = '''def gqa_forward(X, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads, mask=None):
    """np.take with the index of each query head's key/value head."""
    B, L, d_model = X.shape
    d_k = d_model // num_heads
    Q = np.swapaxes((X @ W_Q).reshape(B, L, num_heads, d_k), 1, 2)
    K = np.swapaxes((X @ W_K).reshape(B, L, num_kv_heads, d_k), 1, 2)
    V = np.swapaxes((X @ W_V).reshape(B, L, num_kv_heads, d_k), 1, 2)
    kv_of = np.arange(num_heads) // (num_heads // num_kv_heads)  # [0, 0, 1, 1, ...]
    K, V = np.take(K, kv_of, axis=1), np.take(V, kv_of, axis=1)  # (B, h, L, d_k)
    s = Q @ np.swapaxes(K, -1, -2) / np.sqrt(d_k)
    if mask is not None:
        s = s + mask
    return np.moveaxis(softmax(s) @ V, 1, 2).reshape(B, L, d_model) @ W_O
'''

KV_NUMPY = '''def kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_element):
    elements = np.prod([2, n_layers, n_kv_heads, head_dim, seq_len, batch_size], dtype=np.int64)
    return int(elements) * bytes_per_element
'''

DECODE_OWN_SOFTMAX = '''def decode_step(x, cache_k, cache_v, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads):
    """np.take for the key/value head of each query head, a softmax written out."""
    B, _, d_model = x.shape
    d_k = d_model // num_heads
    split = lambda t, n: np.swapaxes(t.reshape(B, 1, n, d_k), 1, 2)  # (B, 1, n*d_k) -> (B, n, 1, d_k)
    cache_k = np.concatenate((cache_k, split(x @ W_K, num_kv_heads)), axis=-2)
    cache_v = np.concatenate((cache_v, split(x @ W_V, num_kv_heads)), axis=-2)
    kv_of = np.arange(num_heads) // (num_heads // num_kv_heads)
    s = split(x @ W_Q, num_heads) @ np.swapaxes(np.take(cache_k, kv_of, axis=1), -1, -2) / np.sqrt(d_k)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    z = (p / p.sum(axis=-1, keepdims=True)) @ np.take(cache_v, kv_of, axis=1)  # (B, h, 1, d_k)
    return np.swapaxes(z, 1, 2).reshape(B, 1, d_model) @ W_O, cache_k, cache_v
'''

VARIANTS = [
    Variant("einsum, grouped queries, math.prod, np.append",
            {"ans_mqa_forward": MQA_EINSUM, "ans_gqa_forward": GQA_GROUPED, "ans_kv_cache_bytes": KV_PROD,
             DECODE: DECODE_EINSUM}),
    Variant("loops over heads, preallocated caches",
            {"ans_mqa_forward": MQA_HEAD_LOOP, "ans_gqa_forward": GQA_HEAD_LOOP, "ans_kv_cache_bytes": KV_LOOP,
             DECODE: DECODE_PREALLOCATED}),
    Variant("swapaxes/moveaxis, np.take, softmax written out",
            {"ans_mqa_forward": MQA_SWAPAXES, "ans_gqa_forward": GQA_TAKE, "ans_kv_cache_bytes": KV_NUMPY,
             DECODE: DECODE_OWN_SOFTMAX}),
]

# --- bugs that show only for a batch above 1: each must fail a visible test (``breaks``) of the release ---

BATCH_MUTANTS = [
    Mutant("mqa_forward: [None] for [:, None]", "ans_mqa_forward",
           "K = (X @ W_K)[:, None]", "K = (X @ W_K)[None]", {"mqa_forward_values"}, "batch"),
    Mutant("gqa_forward: queries reshaped across the batch", "ans_gqa_forward",
           "Q = (X @ W_Q).reshape(B, L, num_heads, d_k).transpose(0, 2, 1, 3)",
           "Q = (X @ W_Q).reshape(L, B, num_heads, d_k).transpose(1, 2, 0, 3)",
           {"gqa_forward_values", "gqa_forward_limits"}, "batch"),
    Mutant("kv_cache_bytes: one sequence", "ans_kv_cache_bytes", " * batch_size", "",
           {"kv_cache_bytes_values"}, "batch"),
    Mutant("decode_step: every sequence reads the first one's cache", DECODE,
           "scores = q @ K.transpose(0, 1, 3, 2) / np.sqrt(d_k)",
           "scores = q @ K[:1].transpose(0, 1, 3, 2) / np.sqrt(d_k)",
           {"decode_step_values", "decode_step_sequence"}, "batch"),
]
