"""KV-cache decoding in NumPy: prefill + token-by-token decoding equals the causal forward."""

import numpy as np
import pytest

from mha_lab.analysis import MODEL_CONFIGS, ModelConfig, decode_step_cost, kv_cache_bytes
from mha_lab.cpu import GroupedQueryAttention, create_causal_mask, repeat_kv, scaled_dot_product_attention
from mha_lab.cpu.decode import KVCache, decode_step, prefill
from mha_lab.testing import assert_close

D_MODEL, H = 24, 4  # d_k = 6
LAYOUTS = {"MHA": 4, "GQA": 2, "MQA": 1}
N_DECODE = 5


def layer_with_biases(h_kv: int, seed: int = 0) -> GroupedQueryAttention:
    """A float64 layer with random biases (zero biases would test nothing)."""
    layer = GroupedQueryAttention(D_MODEL, H, h_kv, use_bias=True, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name, p in layer.parameters().items():
        if name.startswith("b_"):
            setattr(layer, name, rng.standard_normal(p.shape))
    return layer


def generate(layer, X, prompt_len, **cache_size):
    """Prefill X[:, :prompt_len], decode the rest one token at a time; all outputs and the cache."""
    cache = KVCache.for_layer(layer, X.shape[0], **cache_size)
    outs = [prefill(layer, X[:, :prompt_len], cache)]
    outs += [decode_step(layer, X[:, t:t + 1], cache) for t in range(prompt_len, X.shape[1])]
    return np.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt_len", [1, 7, 33])
def test_decoding_equals_the_causal_forward(layout, prompt_len):
    layer = layer_with_biases(LAYOUTS[layout])
    L = prompt_len + N_DECODE
    X = np.random.default_rng(prompt_len).standard_normal((3, L, D_MODEL))
    got, cache = generate(layer, X, prompt_len, max_len=L)
    assert_close(got, layer.forward(X, create_causal_mask(L)), err_msg=layout)
    assert cache.length == L and cache.keys.shape == (3, LAYOUTS[layout], L, D_MODEL // H)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt_len", [1, 7, 33])
def test_sliding_window_decoding_equals_the_windowed_forward(layout, prompt_len):
    W = 6
    layer = layer_with_biases(LAYOUTS[layout], seed=3)
    L = prompt_len + N_DECODE
    X = np.random.default_rng(prompt_len).standard_normal((2, L, D_MODEL))
    got, cache = generate(layer, X, prompt_len, window=W)
    assert_close(got, layer.forward(X, create_causal_mask(L, window=W)), err_msg=layout)
    assert cache.keys.shape[2] == min(L, W)


def test_past_the_window_the_oldest_token_is_evicted():
    W = 4
    layer = layer_with_biases(2)
    X = np.random.default_rng(0).standard_normal((1, 11, D_MODEL))
    _, cache = generate(layer, X, 3, window=W)
    _, K, _ = layer.project_qkv(X)  # (1, h_kv, 11, d_k)
    assert cache.length == 11 and cache.keys.shape[2] == W
    for p in range(11 - W, 11):  # the last W positions, position p in slot p % W
        assert_close(cache.keys[:, :, p % W], K[:, :, p])


def test_a_full_cache_raises_and_is_left_unchanged():
    layer = layer_with_biases(2)
    X = np.random.default_rng(0).standard_normal((2, 5, D_MODEL))
    _, cache = generate(layer, X, 3, max_len=5)
    before = cache.keys.copy()
    with pytest.raises(ValueError, match="KV cache is full: it holds max_len=5"):
        decode_step(layer, X[:, :1], cache)
    assert cache.length == 5 and np.array_equal(cache.keys, before)
    with pytest.raises(ValueError, match="KV cache is full"):
        prefill(layer, X, KVCache.for_layer(layer, 2, max_len=4))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_measured_cache_bytes_equal_kv_cache_bytes(layout):
    h_kv, B, d_k = LAYOUTS[layout], 3, D_MODEL // H
    layer = layer_with_biases(h_kv)
    X = np.random.default_rng(0).standard_normal((B, 20, D_MODEL))
    one_layer = ModelConfig(layout, n_layers=1, d_model=D_MODEL, n_heads=H, n_kv_heads=h_kv, head_dim=d_k)
    cache = KVCache.for_layer(layer, B, max_len=20)
    assert cache.nbytes == kv_cache_bytes(one_layer, 20, B, dtype="float64")
    prefill(layer, X[:, :7], cache)
    for t in range(7, 20):  # the filled part grows by one position per token
        used = cache.keys.nbytes + cache.values.nbytes
        assert used == kv_cache_bytes(one_layer, t, B, dtype="float64")
        decode_step(layer, X[:, t:t + 1], cache)
    windowed = ModelConfig(layout, 1, D_MODEL, H, h_kv, d_k, sliding_window=8)
    cache = KVCache.for_layer(layer, B, window=8)
    prefill(layer, X, cache)
    assert cache.nbytes == cache.keys.nbytes + cache.values.nbytes == kv_cache_bytes(windowed, 20, B, "float64")


def test_the_cache_holds_only_the_key_value_heads():
    """h_kv heads: a cache shaped for the h query heads (the repeated K/V) is refused."""
    layer = layer_with_biases(1)
    X = np.random.default_rng(0).standard_normal((1, 3, D_MODEL))
    cache = KVCache.for_layer(layer, 1, max_len=3)
    assert cache.k.shape == (1, 1, 3, D_MODEL // H)
    with pytest.raises(ValueError, match=r"\(B, h_kv, capacity, d_k\)"):
        prefill(layer, X, KVCache(1, H, D_MODEL // H, max_len=3))


def test_bad_input_errors_name_the_problem():
    layer = layer_with_biases(2)
    X = np.random.default_rng(0).standard_normal((1, 4, D_MODEL))
    cache = KVCache.for_layer(layer, 1, max_len=8)
    prefill(layer, X, cache)
    with pytest.raises(ValueError, match="one token per sequence"):
        decode_step(layer, X[:, :2], cache)
    with pytest.raises(ValueError, match="prefill needs an empty cache"):
        prefill(layer, X, cache)
    with pytest.raises(ValueError, match="d_model=5"):
        decode_step(layer, np.zeros((1, 1, 5)), cache)
    with pytest.raises(ValueError, match="float64"):
        prefill(layer, X, KVCache(1, 2, 6, max_len=8, dtype=np.float32))
    with pytest.raises(ValueError, match="exactly one"):
        KVCache(1, 2, 6, max_len=8, window=4)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache(1, 2, 6)
    with pytest.raises(ValueError, match="window must be at least 1"):
        KVCache(1, 2, 6, window=0)


def test_sliding_window_mask_keeps_the_last_w_positions():
    allowed = create_causal_mask(6, window=3)[0, 0] == 0
    i, j = np.indices((6, 6))
    assert np.array_equal(allowed, (j <= i) & (i - j < 3))
    assert np.array_equal(create_causal_mask(6, window=6), create_causal_mask(6))


@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_grouped_core_equals_repeated_heads(h_kv):
    """enable_gqa shares K/V heads by broadcasting and matches the copy made by repeat_kv."""
    rng = np.random.default_rng(h_kv)
    Q = rng.standard_normal((2, H, 5, 3))
    K, V = rng.standard_normal((2, 2, h_kv, 7, 3))
    for mask in (None, create_causal_mask(7)[..., 2:, :], np.log(rng.uniform(size=(2, H, 5, 7)))):
        out, A = scaled_dot_product_attention(Q, K, V, mask, enable_gqa=True)
        ref_out, ref_A = scaled_dot_product_attention(Q, repeat_kv(K, H // h_kv), repeat_kv(V, H // h_kv), mask)
        assert_close(out, ref_out)
        assert_close(A, ref_A)
    with pytest.raises(ValueError, match="not divisible by the 3 key/value heads"):
        scaled_dot_product_attention(Q, K[:, :1].repeat(3, axis=1), V[:, :1].repeat(3, axis=1), enable_gqa=True)


def test_decode_step_cost_counts_what_a_step_reads_and_computes():
    B, t, h_kv = 3, 10, 2
    layer = GroupedQueryAttention(D_MODEL, H, h_kv, dtype=np.float32)
    cache = KVCache.for_layer(layer, B, max_len=t)
    cost = decode_step_cost(D_MODEL, H, h_kv, t, B, dtype="float32")
    n_weights = sum(p.size for p in layer.parameters().values())
    assert cost["weight_bytes"] == sum(p.nbytes for p in layer.parameters().values())
    assert cost["cache_bytes"] == cache.nbytes
    assert cost["proj_flops"] == 2 * B * n_weights  # one multiply-add per weight and token
    d_k = D_MODEL // H  # q k^T and A v: t multiply-adds of length d_k per head; softmax 5 per score
    assert cost["attn_flops"] == B * H * (2 * 2 * t * d_k + 5 * t)


def test_attention_intensity_of_decoding_is_2_h_over_g_per_element_size():
    for c in MODEL_CONFIGS.values():
        for B, t in ((1, 512), (64, 4096)):
            cost = decode_step_cost(c.d_model, c.n_heads, c.n_kv_heads, t, B, "float16", softmax_flops=0)
            assert cost["attn_flops"] / cost["cache_bytes"] == 2 * (c.n_heads / c.n_kv_heads) / 2
