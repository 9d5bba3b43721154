"""KV-cache decoding in PyTorch: prefill + token-by-token decoding equals the causal forward."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mha_lab.analysis import ModelConfig, kv_cache_bytes  # noqa: E402
from mha_lab.cuda import MultiHeadAttention  # noqa: E402
from mha_lab.cuda.attention import causal_mask  # noqa: E402
from mha_lab.cuda.decode import KVCache, decode_step, prefill  # noqa: E402
from mha_lab.testing import assert_close  # noqa: E402

D_MODEL, H = 24, 4  # d_k = 6
LAYOUTS = {"MHA": 4, "GQA": 2, "MQA": 1}
N_DECODE = 5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def layer_with_biases(h_kv: int, device="cpu", seed: int = 0) -> MultiHeadAttention:
    """A float64 causal layer with random biases (zero biases would test nothing)."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(D_MODEL, H, h_kv, causal=True, bias=True, device=device, dtype=torch.float64)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith("b_"):
                p.normal_()
    return layer


def generate(layer, x, prompt_len, **cache_size):
    """Prefill x[:, :prompt_len], decode the rest one token at a time; all outputs and the cache."""
    cache = KVCache.for_layer(layer, x.shape[0], **cache_size)
    outs = [prefill(layer, x[:, :prompt_len], cache)]
    outs += [decode_step(layer, x[:, t:t + 1], cache) for t in range(prompt_len, x.shape[1])]
    return torch.cat(outs, dim=1), cache


def as_numpy(t):
    return t.detach().cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt_len", [1, 7, 33])
def test_decoding_equals_the_causal_forward(device, layout, prompt_len):
    layer = layer_with_biases(LAYOUTS[layout], device)
    L = prompt_len + N_DECODE
    x = torch.randn(3, L, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(L)).to(device)
    got, cache = generate(layer, x, prompt_len, max_len=L)
    with torch.no_grad():
        assert_close(as_numpy(got), as_numpy(layer(x)), err_msg=layout)
    assert cache.length == L and tuple(cache.keys.shape) == (3, LAYOUTS[layout], L, D_MODEL // H)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt_len", [1, 7, 33])
def test_sliding_window_decoding_equals_the_windowed_forward(device, layout, prompt_len):
    W = 6
    layer = layer_with_biases(LAYOUTS[layout], device, seed=3)
    L = prompt_len + N_DECODE
    x = torch.randn(2, L, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(L)).to(device)
    got, cache = generate(layer, x, prompt_len, window=W)
    with torch.no_grad():
        want = layer(x, attn_mask=causal_mask(L, W, device))
    assert_close(as_numpy(got), as_numpy(want), err_msg=layout)
    assert cache.keys.shape[2] == min(L, W)


def test_causal_mask_keeps_the_past_and_a_window_its_last_w_positions():
    i, j = np.indices((6, 6))
    assert np.array_equal(causal_mask(6).numpy(), j <= i)
    assert np.array_equal(causal_mask(6, 3).numpy(), (j <= i) & (i - j < 3))


def test_a_full_cache_raises_and_past_the_window_evicts():
    layer = layer_with_biases(2)
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    _, cache = generate(layer, x[:, :5], 3, max_len=5)
    with pytest.raises(ValueError, match="KV cache is full: it holds max_len=5"):
        decode_step(layer, x[:, 5:6], cache)
    assert cache.length == 5
    _, cache = generate(layer, x, 2, window=4)
    with torch.no_grad():
        _, k, _ = layer.project_qkv(x)  # (2, h_kv, 9, d_k)
    assert cache.length == 9 and cache.keys.shape[2] == 4
    for p in range(5, 9):  # the last W positions, position p in slot p % W
        assert_close(as_numpy(cache.keys[:, :, p % 4]), as_numpy(k[:, :, p]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_measured_cache_bytes_equal_kv_cache_bytes(layout):
    h_kv, B = LAYOUTS[layout], 2
    layer = layer_with_biases(h_kv).to(torch.float16)
    one_layer = ModelConfig(layout, n_layers=1, d_model=D_MODEL, n_heads=H, n_kv_heads=h_kv, head_dim=D_MODEL // H)
    cache = KVCache.for_layer(layer, B, max_len=16)
    assert cache.nbytes == kv_cache_bytes(one_layer, 16, B, dtype="float16")
    x = torch.randn(B, 16, D_MODEL, dtype=torch.float16)
    prefill(layer, x[:, :4], cache)
    for t in range(4, 16):  # the filled part grows by one position per token
        assert cache.keys.nbytes + cache.values.nbytes == kv_cache_bytes(one_layer, t, B, dtype="float16")
        decode_step(layer, x[:, t:t + 1], cache)


def test_bad_input_errors_name_the_problem():
    layer = layer_with_biases(2)
    x = torch.randn(1, 4, D_MODEL, dtype=torch.float64)
    cache = KVCache.for_layer(layer, 1, max_len=8)
    prefill(layer, x, cache)
    with pytest.raises(ValueError, match="one token per sequence"):
        decode_step(layer, x[:, :2], cache)
    with pytest.raises(ValueError, match="prefill needs an empty cache"):
        prefill(layer, x, cache)
    with pytest.raises(ValueError, match=r"\(B, h_kv, capacity, d_k\)"):
        prefill(layer, x, KVCache(1, H, D_MODEL // H, max_len=8, dtype=torch.float64))  # h heads, not h_kv
    with pytest.raises(ValueError, match="float32"):
        prefill(layer, x, KVCache(1, 2, 6, max_len=8))
    with pytest.raises(ValueError, match="exactly one"):
        KVCache(1, 2, 6, max_len=8, window=4)
