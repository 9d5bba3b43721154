"""Hidden checks of ps2_mqa: multi-query attention, grouped-query attention, the KV cache size,
decoding one token against the KV cache.

Each check: (1) make seeded inputs on shapes the notebook's visible tests do not use,
(2) call the student's function, (3) judge it against mha_lab's reference.

Bugs the checks name, and the tasks they can occur in: np.tile for np.repeat wherever key/value heads are expanded
for the query heads (gqa_forward, decode_step; with one key/value head, as in mqa_forward, the two agree); the scale
1/sqrt(d_model) wherever scores are computed (mqa_forward, gqa_forward, decode_step).
"""

import copy

import numpy as np

from mha_lab.analysis import MODEL_CONFIGS, kv_cache_bytes
from mha_lab.cpu import (
    GroupedQueryAttention,
    MultiHeadAttention,
    create_causal_mask,
    merge_heads,
    repeat_kv,
    scaled_dot_product_attention,
    split_heads,
)
from mha_lab.grading import checks

# the package's own code for each task (the book prints it): what the class report's similarity compares answers with
PACKAGE_ANSWERS = {"mqa_forward": ["mha_lab.cpu.GroupedQueryAttention.forward", "mha_lab.cpu.repeat_kv"],
                   "gqa_forward": ["mha_lab.cpu.GroupedQueryAttention.forward", "mha_lab.cpu.repeat_kv"],
                   "kv_cache_bytes": ["mha_lab.analysis.kv_cache_bytes"], "decode_step": ["mha_lab.cpu.decode_step"]}
LAYOUT_HINT = ("(B, L, h*d_k) -> (B, L, h, d_k) -> (B, h, L, d_k) and back: reshape and transpose in that "
               "order. Did you reshape without transposing? [bug: reshape-no-transpose]")
SCALE_HINT = "scale the scores by 1/sqrt(d_k), the head size, not by 1/sqrt(d_model) [bug: scale-d-model]"
MASK_HINT = ("the additive mask is 0 where attention is allowed and -inf where it is not: add it to the "
             "scores. Is the mask inverted? [bug: mask-inverted]")
GROUP_HINT = ("key/value head j serves query heads j*n_rep ... (j+1)*n_rep - 1: repeat each head in place "
              "(np.repeat on the head axis, torch's repeat_interleave), not the whole stack (np.tile)"
              " [bug: tile-not-repeat]")
_rng = checks.fresh_inputs()  # new inputs in every grading run


def _scale_hint(out, layer, X, mask, other: str) -> str:
    """SCALE_HINT when ``out`` is what dividing the scores by sqrt(d_model) gives, else ``other``."""
    wrong = copy.copy(layer)
    wrong.W_Q = layer.W_Q * np.sqrt(layer.d_k / layer.d_model)
    candidate = wrong.forward(X, mask=mask)
    if np.shape(out) == candidate.shape and np.allclose(out, candidate, rtol=1e-8, atol=1e-10):
        return SCALE_HINT
    return other


def _group_hint(out, layer, X, mask, other: str) -> str:
    """``_scale_hint``, or ``other`` with the one id tile-not-repeat when ``out`` is what np.tile gives: query head
    i then meets K/V head i % g; a layer whose query heads are permuted to match shows it (the words stay)."""
    g, n_rep, d_k = layer.num_kv_heads, layer.n_rep, layer.d_k
    order = [r * g + j for j in range(g) for r in range(n_rep)]  # head at position j*n_rep + r is head r*g + j
    cols = np.concatenate([np.arange(i * d_k, (i + 1) * d_k) for i in order])
    wrong = copy.copy(layer)
    wrong.W_Q, wrong.W_O = layer.W_Q[:, cols], layer.W_O[cols, :]
    candidate = wrong.forward(X, mask=mask)
    if np.shape(out) == candidate.shape and np.allclose(out, candidate, rtol=1e-8, atol=1e-10):
        return checks.retag(other, "tile-not-repeat")
    return _scale_hint(out, layer, X, mask, other)


def _gqa_inputs(salt: int, B: int, L: int, d_model: int, h: int, g: int):
    layer = GroupedQueryAttention(d_model, h, g, seed=int(_rng(90_000 + salt).integers(2**31)))
    X = _rng(30_000 + salt).normal(size=(B, L, d_model))
    return layer, X, (X, layer.W_Q, layer.W_K, layer.W_V, layer.W_O, h)


# --- task 1: mqa_forward ------------------------------------------------------------------------


def test_mqa_forward_shape(student):
    layer, X, args = _gqa_inputs(1, B=3, L=5, d_model=12, h=4, g=1)

    out = checks.call(student, "mqa_forward", *args)

    checks.expect_array(out, what="mqa_forward output (B=3, L=5, d_model=12, h=4)", shape=(3, 5, 12))


def test_mqa_forward_values(student):
    layer, X, args = _gqa_inputs(2, B=2, L=7, d_model=12, h=3, g=1)
    expected = layer.forward(X)

    out = checks.call(student, "mqa_forward", *args)

    checks.expect_array(out, what="mqa_forward output", shape=expected.shape)
    checks.expect_close(out, expected, what="mqa_forward output vs the reference MQA layer",
                        hint=_scale_hint(out, layer, X, None, LAYOUT_HINT))


def test_mqa_forward_mask(student):
    layer, X, args = _gqa_inputs(3, B=2, L=6, d_model=8, h=4, g=1)
    causal = create_causal_mask(6)
    expected = layer.forward(X, mask=causal)

    out = checks.call(student, "mqa_forward", *args, mask=causal)

    checks.expect_array(out, what="mqa_forward output with a causal mask", shape=expected.shape, hint=MASK_HINT)
    checks.expect_close(out, expected, what="mqa_forward with a causal mask vs the reference",
                        hint=_scale_hint(out, layer, X, causal, _mask_hint(student, layer, X, args)))


def _mask_hint(student, layer, X, args, name: str = "mqa_forward", wrong: str = "") -> str:
    """MASK_HINT only when the output of ``name`` without a mask is right: otherwise the mask may well be fine
    (``wrong``, or a pointer to the values check, says what to fix instead)."""
    try:
        plain = checks.call(student, name, *args)
    except AssertionError:
        plain = None
    if np.shape(plain) == X.shape and np.allclose(plain, layer.forward(X), rtol=1e-8, atol=1e-10):
        return MASK_HINT
    return wrong or ("the output without a mask is wrong too, so the mask may be fine: fix what "
                     f"{name}_values reports first")


# --- task 2: gqa_forward ------------------------------------------------------------------------


def test_gqa_forward_values(student):
    layer, X, args = _gqa_inputs(4, B=2, L=5, d_model=24, h=6, g=2)  # n_rep = 3
    expected = layer.forward(X)

    out = checks.call(student, "gqa_forward", *args, 2)

    checks.expect_array(out, what="gqa_forward output (h=6, num_kv_heads=2)", shape=expected.shape)
    checks.expect_close(out, expected, what="gqa_forward (h=6, num_kv_heads=2) vs the reference GQA layer",
                        hint=_group_hint(out, layer, X, None, f"{GROUP_HINT}. Or: {LAYOUT_HINT}"))


def test_gqa_forward_values__causal(student):
    layer, X, args = _gqa_inputs(5, B=3, L=4, d_model=16, h=4, g=2)
    causal = create_causal_mask(4)
    expected = layer.forward(X, mask=causal)

    out = checks.call(student, "gqa_forward", *args, 2, mask=causal)

    checks.expect_array(out, what="gqa_forward output with a causal mask", shape=expected.shape, hint=MASK_HINT)
    checks.expect_close(out, expected, what="gqa_forward (h=4, num_kv_heads=2, causal) vs the reference",
                        hint=_group_hint(out, layer, X, causal, _mask_hint(student, layer, X, (*args, 2), "gqa_forward",
                                                                           f"{GROUP_HINT}. Or: {LAYOUT_HINT}")))


def test_gqa_forward_limits(student):
    mha = MultiHeadAttention(12, 4, seed=int(_rng(90_006).integers(2**31)))
    X = _rng(6).normal(size=(2, 5, 12))
    expected = mha.forward(X)

    out = checks.call(student, "gqa_forward", X, mha.W_Q, mha.W_K, mha.W_V, mha.W_O, 4, 4)

    checks.expect_array(out, what="gqa_forward with num_kv_heads = num_heads", shape=expected.shape)
    checks.expect_close(out, expected, what="gqa_forward with num_kv_heads = num_heads must equal MHA",
                        hint=_scale_hint(out, mha, X, None, LAYOUT_HINT))


def test_gqa_forward_limits__mqa(student):
    layer, X, args = _gqa_inputs(7, B=2, L=3, d_model=10, h=5, g=1)
    expected = layer.forward(X)

    out = checks.call(student, "gqa_forward", *args, 1)

    checks.expect_array(out, what="gqa_forward with num_kv_heads = 1", shape=expected.shape)
    checks.expect_close(out, expected, what="gqa_forward with num_kv_heads = 1 must equal MQA",
                        hint=_scale_hint(out, layer, X, None, LAYOUT_HINT))


# --- task 3: kv_cache_bytes ---------------------------------------------------------------------

CACHE_CASES = [("Llama-2-70B", 4096, 1, "float16", 2), ("Llama-3-8B", 8192, 4, "float16", 2),
               ("GPT-2 XL", 1024, 8, "float32", 4), ("GPT-3 175B", 2048, 2, "float16", 2)]


def test_kv_cache_bytes_values(student):
    cases = [(MODEL_CONFIGS[name], L, B, dtype, size) for name, L, B, dtype, size in CACHE_CASES]

    results = [checks.call(student, "kv_cache_bytes", c.n_layers, c.n_kv_heads, c.head_dim, L, B, size)
               for c, L, B, dtype, size in cases]

    for (config, L, B, dtype, _), got in zip(cases, results, strict=True):
        expected = kv_cache_bytes(config, L, B, dtype)
        what = f"kv_cache_bytes for {config.name} (L={L}, B={B}, {dtype})"
        checks.expect_true(isinstance(got, int | np.integer) and not isinstance(got, bool),
                           what=f"{what}: expected an integer number of bytes, got {type(got).__name__}",
                           hint="multiply integers only [bug: bytes-not-int]")
        ratio = got / expected
        hint = ("keys AND values are cached: did you forget the factor of 2? [bug: no-factor-2]" if ratio == 0.5 else
                "bytes = 2 (K and V) x n_layers x n_kv_heads x head_dim x seq_len x batch_size x bytes_per_element"
                " [bug: kv-cache-formula]")
        checks.expect_true(got == expected, what=f"{what}: expected {expected:,} bytes, got {int(got):,}", hint=hint)


# --- task 4: decode_step ------------------------------------------------------------------------
# The reference is the causal forward of the whole sequence: prefill + token by token must equal it.

CACHE_HEADS_HINT = ("the cache holds the g = num_kv_heads key/value heads, not the h repeated ones (that is what "
                    "makes the GQA cache h/g times smaller): append the new token's g heads, and repeat them for "
                    "the query heads only inside the attention [bug: cache-repeated-heads]")
CACHE_V_HINT = ("the value cache got the new token's key: append v = x @ W_V (split into g heads) to cache_v"
                " [bug: key-in-value-cache]")
POSITION = ("the new token is the LAST row of the causal mask (position T): it sees every cached token and "
            "itself, so nothing of the cache is masked")
POSITION_HINT = POSITION + " [bug: new-token-last-row]"
SELF_HINT = ("the new token must see itself: append its key and value to the cache first, then attend over all "
             "T + 1 of them [bug: new-token-sees-itself]")


def _decode_problem(salt: int, B: int, L: int, d_model: int, h: int, g: int):
    layer = GroupedQueryAttention(d_model, h, g, seed=int(_rng(91_000 + salt).integers(2**31)))
    X = _rng(40_000 + salt).normal(size=(B, L, d_model))
    expected = layer.forward(X, mask=create_causal_mask(L))  # (B, L, d_model)
    return layer, X, expected


def _kv(layer, X) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values of the tokens X, as the cache holds them: (B, g, T, d_k) each."""
    g = layer.num_kv_heads
    return split_heads(X @ layer.W_K, g), split_heads(X @ layer.W_V, g)


def _tile(K: np.ndarray, n_rep: int) -> np.ndarray:
    """The stack of g heads repeated whole (np.tile): query head i meets key/value head i % g."""
    return np.tile(K, (1, n_rep, 1, 1))  # (B, g, S, d_k) -> (B, g * n_rep, S, d_k)


def _attend(layer, x, K, V, expand=repeat_kv, q_scale: float = 1.0) -> np.ndarray:
    """The output of the one token x (B, 1, d_model) attending over K, V (B, g, S, d_k), unmasked; ``expand``
    and ``q_scale`` give the answers of two bugs (np.tile, the scale 1/sqrt(d_model))."""
    q = split_heads(x @ layer.W_Q, layer.num_heads) * q_scale  # (B, h, 1, d_k)
    Z, _ = scaled_dot_product_attention(q, expand(K, layer.n_rep), expand(V, layer.n_rep))
    return merge_heads(Z) @ layer.W_O  # (B, h, 1, d_k) -> (B, 1, d_model)


def _head_bug(layer, same) -> str | None:
    """GROUP_HINT or SCALE_HINT when ``same(attend)`` holds for the attention that bug gives, else None."""
    if layer.n_rep > 1 and layer.num_kv_heads > 1 and same(lambda x, K, V: _attend(layer, x, K, V, expand=_tile)):
        return GROUP_HINT
    if same(lambda x, K, V: _attend(layer, x, K, V, q_scale=np.sqrt(layer.d_k / layer.d_model))):
        return SCALE_HINT
    return None


def _weights(layer, h: int, g: int) -> tuple:
    return layer.W_Q, layer.W_K, layer.W_V, layer.W_O, h, g


def _call_decode(student, x, cache_k, cache_v, layer, h, g, what):
    result = checks.call(student, "decode_step", x, cache_k, cache_v, *_weights(layer, h, g))
    checks.expect_true(isinstance(result, tuple) and len(result) == 3,
                       what=f"{what}: decode_step should return (out, cache_k, cache_v), got {type(result).__name__}",
                       hint="return out, cache_k, cache_v [bug: return-out-caches]")
    return result


def _expect_cache_shape(cache, shape: tuple[int, ...], h: int, what: str) -> None:
    """(B, g, T + 1, d_k), with the hint that names caching the h repeated heads."""
    got = np.shape(cache)
    g = shape[1]
    hint = (CACHE_HEADS_HINT if len(got) == 4 and got[1] == h != g else
            "append the new token's (B, g, 1, d_k) key and value along the position axis (axis 2) [bug: cache-axis]")
    checks.expect_true(got == shape, what=f"{what}: expected shape (B, g, T + 1, d_k) = {shape}, got {got}", hint=hint)


def _check_cache(student, salt, B, T, d_model, h, g):
    # 1. inputs: a cache of the first T tokens, then token T
    layer, X, _ = _decode_problem(salt, B, T + 1, d_model, h, g)
    d_k = d_model // h
    cache_k, cache_v = _kv(layer, X[:, :T])
    new_k, new_v = _kv(layer, X[:, T:T + 1])  # (B, g, 1, d_k)
    # 2. call
    what = f"decode_step's caches (B={B}, T={T} cached, h={h}, g={g})"
    _, got_k, got_v = _call_decode(student, X[:, T:T + 1], cache_k, cache_v, layer, h, g, what)
    # 3. judge
    for name, got in (("cache_k", got_k), ("cache_v", got_v)):
        _expect_cache_shape(got, (B, g, T + 1, d_k), h, f"{what}: {name}")
        checks.expect_array(got, what=f"{what}: {name}", shape=(B, g, T + 1, d_k))
    checks.expect_close(got_k[:, :, :T], cache_k, what=f"{what}: the cached keys must stay as they were",
                        hint="append the new key at the end (position T), do not change or reorder the cache"
                             " [bug: key-appended-wrong]")
    checks.expect_close(got_k[:, :, T:], new_k, what=f"{what}: the key appended at position T",
                        hint="k = x @ W_K split into g heads: (B, 1, g*d_k) -> (B, g, 1, d_k), at the END of the cache"
                             " [bug: key-projection]")
    checks.expect_close(got_v[:, :, :T], cache_v, what=f"{what}: the cached values must stay as they were",
                        hint="append the new value at the end (position T), do not change or reorder the cache"
                             " [bug: value-appended-wrong]")
    v_hint = CACHE_V_HINT if np.allclose(got_v[:, :, T:], new_k) else (
        "v = x @ W_V split into g heads: (B, 1, g*d_k) -> (B, g, 1, d_k), at the END of the cache"
        " [bug: value-projection]")
    checks.expect_close(got_v[:, :, T:], new_v, what=f"{what}: the value appended at position T", hint=v_hint)


def test_decode_step_cache(student):
    _check_cache(student, 1, B=2, T=6, d_model=24, h=6, g=2)


def test_decode_step_cache__empty_mqa(student):
    _check_cache(student, 2, B=3, T=0, d_model=12, h=4, g=1)


def _decode_hint(layer, X, T, out, cache_k, cache_v) -> str:
    """Name the bug by the wrong answer it gives, for the new token at position T."""
    x = X[:, T:T + 1]
    new_k, new_v = _kv(layer, x)
    K, V = np.concatenate([cache_k, new_k], axis=2), np.concatenate([cache_v, new_v], axis=2)

    def same(candidate):
        return candidate.shape == np.shape(out) and bool(np.allclose(out, candidate, rtol=1e-8, atol=1e-10))

    if T > 0 and same(_attend(layer, x, cache_k, cache_v)):
        return SELF_HINT
    if T > 0 and same(_attend(layer, x, K[:, :, :1], V[:, :, :1])):
        return POSITION + " (your new token saw only token 0: the FIRST row of the mask) [bug: first-row-of-mask]"
    if same(_attend(layer, x, K, np.concatenate([cache_v, new_k], axis=2))):
        return CACHE_V_HINT
    named = _head_bug(layer, lambda attend: same(attend(x, K, V)))
    if named:
        return named
    return (f"{POSITION}. Also: q, k, v = x @ W split into h, g, g heads; repeat each cached key/value head "
            f"h/g times in place (np.repeat on axis 1); scale by 1/sqrt(d_k) [bug: decode-projection]")


def _check_values(student, salt, B, T, d_model, h, g):
    # 1. inputs: the exact cache of the first T tokens (computed here), then token T
    layer, X, expected = _decode_problem(salt, B, T + 1, d_model, h, g)
    cache_k, cache_v = _kv(layer, X[:, :T])
    # 2. call
    what = f"decode_step's output for token {T} (B={B}, h={h}, g={g}) vs the causal forward of the sequence"
    out, _, _ = _call_decode(student, X[:, T:T + 1], cache_k, cache_v, layer, h, g, what)
    # 3. judge
    checks.expect_array(out, what=what, shape=(B, 1, d_model))
    checks.expect_close(out, expected[:, T:T + 1], what=what, hint=_decode_hint(layer, X, T, out, cache_k, cache_v))


def test_decode_step_values(student):
    _check_values(student, 3, B=2, T=7, d_model=24, h=6, g=3)


def test_decode_step_values__first_token(student):
    _check_values(student, 4, B=1, T=0, d_model=12, h=4, g=2)


def test_decode_step_values__mqa(student):
    _check_values(student, 5, B=3, T=4, d_model=10, h=5, g=1)


def _check_sequence(student, salt, B, prompt, L, d_model, h, g):
    # 1. inputs: the prompt's cache (prefill), then the rest of the sequence decoded token by token
    layer, X, expected = _decode_problem(salt, B, L, d_model, h, g)
    cache_k, cache_v = _kv(layer, X[:, :prompt])
    # 2. call: the student's caches are carried from step to step
    layout = "MHA" if g == h else "MQA" if g == 1 else "GQA"
    what = f"prefill {prompt} tokens, then decode tokens {prompt}..{L - 1} ({layout}: h={h}, g={g}, B={B})"
    outs = []
    for t in range(prompt, L):
        out, cache_k, cache_v = _call_decode(student, X[:, t:t + 1], cache_k, cache_v, layer, h, g, what)
        checks.expect_array(out, what=f"{what}: output of token {t}", shape=(B, 1, d_model))
        outs.append(out)  # the caches' layout is decode_step_cache's to judge: one bug, one penalty
    # 3. judge
    got = np.concatenate(outs, axis=1)  # (B, L - prompt, d_model)
    def same(attend) -> bool:  # the outputs a step that attends so gives, over the right caches
        steps = [attend(X[:, t:t + 1], *_kv(layer, X[:, :t + 1])) for t in range(prompt, L)]
        return got.shape == expected[:, prompt:].shape and bool(
            np.allclose(got, np.concatenate(steps, axis=1), rtol=1e-8, atol=1e-10))

    checks.expect_close(got, expected[:, prompt:], what=f"{what} vs the causal forward of the whole sequence",
                        hint=_head_bug(layer, same) or (
                            "the caches you return are what the next step receives: return them with the new "
                            f"token's key and value appended, g = {g} heads each. {POSITION} [bug: sequence-caches]"))


def test_decode_step_sequence__gqa_prompt_7(student):
    _check_sequence(student, 6, B=2, prompt=7, L=11, d_model=24, h=6, g=2)


def test_decode_step_sequence__mha_prompt_1(student):
    _check_sequence(student, 7, B=1, prompt=1, L=6, d_model=12, h=3, g=3)


def test_decode_step_sequence__mqa_prompt_33(student):
    _check_sequence(student, 8, B=2, prompt=33, L=36, d_model=8, h=4, g=1)


def test_decode_step_sequence__gqa_from_empty(student):
    _check_sequence(student, 9, B=3, prompt=0, L=5, d_model=16, h=4, g=2)
