"""Attention sinks: the StreamingLLM cache decodes like the sink mask on full attention; gpt-oss's sink logit."""

import numpy as np
import pytest

from mha_lab.cpu import GroupedQueryAttention, create_causal_mask, decode_step, scaled_dot_product_attention
from mha_lab.cpu.window import SinkKVCache, attention_with_sink, sink_mask
from mha_lab.testing import assert_close

D_MODEL, H = 24, 4


def test_sink_mask_by_hand():
    m = sink_mask(6, window=2, sinks=1)[0, 0]
    seen = (m == 0).astype(int)
    assert seen.tolist() == [[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 0, 1, 1, 0, 0],
                             [1, 0, 0, 1, 1, 0],
                             [1, 0, 0, 0, 1, 1]]
    assert (sink_mask(6, window=2, sinks=0) == create_causal_mask(6, window=2)).all()


@pytest.mark.parametrize(("h_kv", "window", "sinks"), [(4, 3, 1), (2, 5, 4), (1, 1, 2), (2, 4, 0)])
def test_the_sink_cache_decodes_like_the_sink_mask(h_kv, window, sinks):
    layer = GroupedQueryAttention(D_MODEL, H, h_kv, seed=window)
    T = 17
    X = np.random.default_rng(sinks).standard_normal((2, T, D_MODEL))
    cache = SinkKVCache(2, h_kv, layer.d_k, window=window, sinks=sinks)
    got = np.concatenate([decode_step(layer, X[:, t:t + 1], cache) for t in range(T)], axis=1)
    assert_close(got, layer.forward(X, mask=sink_mask(T, window, sinks)))
    assert cache.keys.shape[2] == sinks + window and cache.nbytes == 2 * 2 * h_kv * (sinks + window) * layer.d_k * 8
    # evicting the sinks too (a plain window of the same size) gives a different output
    assert not np.allclose(got, layer.forward(X, mask=create_causal_mask(T, window=sinks + window))) or sinks == 0


def test_the_sink_cache_takes_one_token_at_a_time():
    cache = SinkKVCache(1, 1, 2, window=2, sinks=1)
    with pytest.raises(ValueError, match="one position at a time"):
        cache.append(np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)))


def test_a_sink_logit_of_zero_is_softmax_plus_one():
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((2, 2, 5, 6)), rng.standard_normal((2, 2, 5, 6))
    out, A = attention_with_sink(Q, K, V, np.zeros(4), mask=create_causal_mask(5))
    e = np.exp(Q @ np.repeat(K, 2, axis=1).swapaxes(-1, -2) / np.sqrt(6) + create_causal_mask(5))
    assert_close(A, e / (1 + e.sum(-1, keepdims=True)))
    assert_close(out, A @ np.repeat(V, 2, axis=1))
    assert (A.sum(-1) < 1).all()


def test_a_very_negative_sink_logit_is_plain_attention_and_a_large_one_silences_the_head():
    rng = np.random.default_rng(1)
    Q, K, V = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 7, 4)), rng.standard_normal((1, 2, 7, 4))
    out, _ = attention_with_sink(Q, K, V, np.array([-1e3, 40.0]))
    assert_close(out[:, :1], scaled_dot_product_attention(Q, K, V)[0][:, :1])
    assert np.abs(out[:, 1]).max() < 1e-15
    with pytest.raises(ValueError, match="one logit per query head"):
        attention_with_sink(Q, K, V, np.zeros(3))
