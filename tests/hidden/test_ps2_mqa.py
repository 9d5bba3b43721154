"""Hidden checks of ps2_mqa: multi-query attention, grouped-query attention, the KV cache size.

Each check: (1) make seeded inputs on shapes the notebook's visible tests do not use,
(2) call the student's function, (3) judge it against mha_lab's reference.
"""

import numpy as np

from mha_lab.analysis import MODEL_CONFIGS, kv_cache_bytes
from mha_lab.cpu import GroupedQueryAttention, MultiHeadAttention, create_causal_mask
from mha_lab.grading import checks

# mha_lab names a student function may use: helpers and model data, not answers
ALLOWED_HELPERS = {"create_causal_mask", "softmax", "ModelConfig", "MODEL_CONFIGS", "gib", "gb"}
LAYOUT_HINT = ("(B, L, h*d_k) -> (B, L, h, d_k) -> (B, h, L, d_k) and back: reshape and transpose in that "
               "order. Did you reshape without transposing?")
SCALE_HINT = "scale the scores by 1/sqrt(d_k), the head size, not by 1/sqrt(d_model)"
MASK_HINT = ("the additive mask is 0 where attention is allowed and -inf where it is not: add it to the "
             "scores. Is the mask inverted?")
GROUP_HINT = ("key/value head j serves query heads j*n_rep ... (j+1)*n_rep - 1: repeat each head in place "
              "(np.repeat on the head axis, torch's repeat_interleave), not the whole stack (np.tile)")


def _gqa_inputs(salt: int, B: int, L: int, d_model: int, h: int, g: int):
    layer = GroupedQueryAttention(d_model, h, g, seed=salt)
    X = np.random.default_rng(30_000 + salt).normal(size=(B, L, d_model))
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
                        hint=f"{SCALE_HINT}; {LAYOUT_HINT}")


def test_mqa_forward_mask(student):
    layer, X, args = _gqa_inputs(3, B=2, L=6, d_model=8, h=4, g=1)
    causal = create_causal_mask(6)
    expected = layer.forward(X, mask=causal)

    out = checks.call(student, "mqa_forward", *args, mask=causal)

    checks.expect_array(out, what="mqa_forward output with a causal mask", shape=expected.shape, hint=MASK_HINT)
    checks.expect_close(out, expected, what="mqa_forward with a causal mask vs the reference",
                        hint=f"{MASK_HINT} Also: {SCALE_HINT}")


# --- task 2: gqa_forward ------------------------------------------------------------------------


def test_gqa_forward_values(student):
    layer, X, args = _gqa_inputs(4, B=2, L=5, d_model=24, h=6, g=2)  # n_rep = 3
    expected = layer.forward(X)

    out = checks.call(student, "gqa_forward", *args, 2)

    checks.expect_array(out, what="gqa_forward output (h=6, num_kv_heads=2)", shape=expected.shape)
    checks.expect_close(out, expected, what="gqa_forward (h=6, num_kv_heads=2) vs the reference GQA layer",
                        hint=f"{GROUP_HINT}. Or: {LAYOUT_HINT}")


def test_gqa_forward_values__causal(student):
    layer, X, args = _gqa_inputs(5, B=3, L=4, d_model=16, h=4, g=2)
    causal = create_causal_mask(4)
    expected = layer.forward(X, mask=causal)

    out = checks.call(student, "gqa_forward", *args, 2, mask=causal)

    checks.expect_array(out, what="gqa_forward output with a causal mask", shape=expected.shape, hint=MASK_HINT)
    checks.expect_close(out, expected, what="gqa_forward (h=4, num_kv_heads=2, causal) vs the reference",
                        hint=f"{GROUP_HINT}. Or: {MASK_HINT}")


def test_gqa_forward_limits(student):
    mha = MultiHeadAttention(12, 4, seed=6)
    X = np.random.default_rng(6).normal(size=(2, 5, 12))
    expected = mha.forward(X)

    out = checks.call(student, "gqa_forward", X, mha.W_Q, mha.W_K, mha.W_V, mha.W_O, 4, 4)

    checks.expect_array(out, what="gqa_forward with num_kv_heads = num_heads", shape=expected.shape)
    checks.expect_close(out, expected, what="gqa_forward with num_kv_heads = num_heads must equal MHA",
                        hint=LAYOUT_HINT)


def test_gqa_forward_limits__mqa(student):
    layer, X, args = _gqa_inputs(7, B=2, L=3, d_model=10, h=5, g=1)
    expected = layer.forward(X)

    out = checks.call(student, "gqa_forward", *args, 1)

    checks.expect_array(out, what="gqa_forward with num_kv_heads = 1", shape=expected.shape)
    checks.expect_close(out, expected, what="gqa_forward with num_kv_heads = 1 must equal MQA", hint=LAYOUT_HINT)


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
                           hint="multiply integers only")
        ratio = got / expected
        hint = ("keys AND values are cached: did you forget the factor of 2?" if ratio == 0.5 else
                "bytes = 2 (K and V) x n_layers x n_kv_heads x head_dim x seq_len x batch_size x bytes_per_element")
        checks.expect_true(got == expected, what=f"{what}: expected {expected:,} bytes, got {int(got):,}", hint=hint)
