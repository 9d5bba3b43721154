"""Memory-efficient forwards: same results as the fused layer, and measurably less memory."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_lab.cpu import (
    MultiHeadAttention,
    chunked_attention,
    chunked_forward,
    create_causal_mask,
    head_by_head_forward,
    repeat_kv,
    scaled_dot_product_attention,
)
from mha_lab.measure import traced_memory
from mha_lab.testing import assert_close


def qkv(B, h, h_kv, Lq, Lk, d, seed=0):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((B, h, Lq, d))
    return Q, rng.standard_normal((B, h_kv, Lk, d)), rng.standard_normal((B, h_kv, Lk, d))


def fused(Q, K, V, mask=None):
    n_rep = Q.shape[1] // K.shape[1]
    return scaled_dot_product_attention(Q, repeat_kv(K, n_rep), repeat_kv(V, n_rep), mask)[0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(1, 40),
       st.integers(1, 17), st.integers(1, 17), st.booleans())
def test_chunked_equals_fused_for_any_block_sizes(B, heads, L, block_q, block_k, causal):
    h, h_kv = heads
    Q, K, V = qkv(B, h, h_kv, L, L, 4, seed=L)
    mask = create_causal_mask(L) if causal else None
    assert_close(chunked_attention(Q, K, V, causal=causal, block_q=block_q, block_k=block_k), fused(Q, K, V, mask))


def test_chunked_with_additive_mask_and_cross_lengths():
    Q, K, V = qkv(2, 4, 2, 7, 13, 5, seed=1)
    pad = np.zeros((2, 1, 1, 13))
    pad[1, ..., 10:] = -np.inf  # key padding for the second sequence
    assert_close(chunked_attention(Q, K, V, mask=pad, block_q=3, block_k=4), fused(Q, K, V, pad))


def test_chunked_is_stable_for_huge_scores():
    Q, K, V = qkv(1, 2, 2, 9, 9, 4, seed=2)
    out = chunked_attention(Q * 300, K, V, block_q=4, block_k=2)
    assert np.all(np.isfinite(out))
    assert_close(out, fused(Q * 300, K, V))


def running_max_tiles(monkeypatch) -> list[int]:
    """Count the tiles that go through ``online_softmax_step``, the running-maximum update."""
    from mha_lab.cpu import memory

    calls, step = [], memory.online_softmax_step
    monkeypatch.setattr(memory, "online_softmax_step", lambda *a: calls.append(1) or step(*a))
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_bounded_scores_skip_the_running_max_and_change_nothing(monkeypatch, causal):
    """Scores of a few units are far inside +-64: no tile needs the maximum, and output and log-sum-exp equal
    the running maximum's. A shortcut that kept m = -inf (lse = -inf) or forgot the denominator fails here."""
    Q, K, V = qkv(2, 4, 2, 12, 12, 8, seed=4)
    tiles = running_max_tiles(monkeypatch)
    out, lse = chunked_attention(Q, K, V, causal=causal, block_q=5, block_k=4, return_lse=True)
    assert not tiles, "a bounded block went through the running maximum"
    kept, kept_lse = chunked_attention(Q, K, V, causal=causal, block_q=5, block_k=4, return_lse=True,
                                       score_bound=0.0)
    assert tiles, "score_bound=0 must keep the running maximum"
    assert_close(out, fused(Q, K, V, create_causal_mask(12) if causal else None))
    assert_close(out, kept)
    assert_close(lse, kept_lse)


def test_blocks_past_the_bound_keep_the_running_max(monkeypatch):
    """Query blocks whose scores reach +-1000 next to a block of small ones, in one call: only the big blocks take
    the running maximum, and all equal the fused result. A bound that forgot the 1/sqrt(d) or |q| would send the
    big blocks down the shortcut, where e^1000 overflows (NaN) and e^-1000 underflows (a 'fully masked' row)."""
    Q, K, V = qkv(1, 2, 2, 12, 10, 4, seed=5)
    Q[:, :, 4:8] *= 400.0  # scores of several hundred, both signs
    Q[:, :, 8:] *= -1000.0
    tiles = running_max_tiles(monkeypatch)
    out = chunked_attention(Q, K, V, block_q=4, block_k=5)
    assert len(tiles) == 2 * 2 * 2, "2 heads x 2 big query blocks x 2 key blocks"
    assert np.all(np.isfinite(out))
    assert_close(out, fused(Q, K, V))


def test_the_default_bound_follows_the_dtype(monkeypatch):
    """float32 holds e^+-88, float64 e^+-709: the default bounds are 8.9 and 71. Scores bounded by 30 take the
    shortcut in float64 and keep the maximum in float32, where one bound of 71 for both would let e^S times the
    values overflow float32's sums far sooner than the running maximum does."""
    Q, K, V = qkv(1, 2, 2, 8, 8, 4, seed=7)
    bound = np.linalg.norm(Q, axis=-1).max() * np.linalg.norm(K, axis=-1).max() / 2  # 1/sqrt(d) = 1/2
    Q *= 30.0 / bound
    tiles = running_max_tiles(monkeypatch)
    assert_close(chunked_attention(Q, K, V, block_q=4, block_k=4), fused(Q, K, V))
    assert not tiles
    Q32, K32, V32 = (t.astype(np.float32) for t in (Q, K, V))
    assert_close(chunked_attention(Q32, K32, V32, block_q=4, block_k=4), fused(Q, K, V), dtype="float32")
    assert len(tiles) == 2 * 2 * 2


def test_a_mask_keeps_the_running_max(monkeypatch):
    """An additive mask moves scores by any amount the bound cannot see: every tile keeps the maximum. With the
    shortcut, the mask's +800 overflows e^S (NaN)."""
    Q, K, V = qkv(1, 2, 2, 6, 6, 4, seed=6)
    mask = np.random.default_rng(0).choice([0.0, -2000.0, 800.0], size=(1, 1, 6, 6))
    tiles = running_max_tiles(monkeypatch)
    assert_close(chunked_attention(Q, K, V, mask=mask, block_q=3, block_k=3), fused(Q, K, V, mask))
    assert len(tiles) == 2 * 2 * 2


def test_chunked_errors():
    Q, K, V = qkv(1, 3, 2, 4, 4, 2)
    with pytest.raises(ValueError, match="not divisible"):
        chunked_attention(Q, K, V)
    Q, K, V = qkv(1, 2, 2, 4, 5, 2)
    with pytest.raises(ValueError, match="causal"):
        chunked_attention(Q, K, V, causal=True)
    with pytest.raises(ValueError, match="block sizes"):
        chunked_attention(Q, K, V, block_q=0)
    with pytest.raises(ValueError, match="fully masked"):
        chunked_attention(Q, K, V, mask=np.full((1, 1, 1, 5), -np.inf))
    with pytest.raises(ValueError, match=r"score_bound must lie in \[0, 354.9\] for float64, got 700"):
        chunked_attention(Q, K, V, score_bound=700)


@pytest.mark.parametrize("causal", [False, True])
def test_head_by_head_equals_forward(causal):
    mha = MultiHeadAttention(24, 4, use_bias=True, seed=0)
    mha.b_O = np.arange(24.0)
    X = np.random.default_rng(0).standard_normal((3, 7, 24))
    mask = create_causal_mask(7) if causal else None
    assert_close(head_by_head_forward(X, mha, mask), mha.forward(X, mask))


def peak_bytes(fn, *args, repeat: int = 1, **kwargs) -> int:
    return traced_memory(lambda: fn(*args, **kwargs), repeat)[1]


@pytest.mark.slow
def test_chunked_peak_is_below_a_sixteenth_of_the_fused_core():
    """B=1, h=8, L=2048, d_model=512: the fused core holds a (1, 8, 2048, 2048) float64 matrix (256 MiB)."""
    Q, K, V = qkv(1, 8, 8, 2048, 2048, 64)
    fused_peak = peak_bytes(scaled_dot_product_attention, Q, K, V)
    chunked_peak = peak_bytes(chunked_attention, Q, K, V)
    assert fused_peak >= 8 * 2048 * 2048 * 8  # the score matrix is really there
    assert chunked_peak < fused_peak / 16, (chunked_peak, fused_peak)


@pytest.mark.slow
def test_head_by_head_peak_is_below_a_quarter_of_the_fused_forward():
    mha = MultiHeadAttention(512, 8, seed=0)
    X = np.random.default_rng(0).standard_normal((1, 2048, 512))
    fused_peak = peak_bytes(mha.forward, X)
    mha.clear_cache()
    hbh_peak = peak_bytes(head_by_head_forward, X, mha)
    assert hbh_peak < fused_peak / 4, (hbh_peak, fused_peak)


def test_attention_matrix_memory_is_B_h_L_squared():
    mha = MultiHeadAttention(64, 8, seed=0)
    B, L = 2, 96
    mha.forward(np.zeros((B, L, 64)))
    assert mha.attention_weights.nbytes == B * 8 * L * L * 8
    Q, K, V = qkv(B, 8, 8, L, L, 8)
    peak = peak_bytes(scaled_dot_product_attention, Q, K, V, repeat=2)  # another thread's allocations count too
    assert B * 8 * L * L * 8 <= peak < 1.5 * B * 8 * L * L * 8


def test_chunked_forward_matches_the_fused_layer():
    layer = MultiHeadAttention(48, 6, seed=3)
    X = np.random.default_rng(0).standard_normal((3, 37, 48))
    assert_close(chunked_forward(X, layer, block_q=8, block_k=16), layer.forward(X))
