"""Cascade attention: a shared prefix attended once for N requests and merged with each request's suffix
equals plain attention over prefix + suffix; the bytes it reads against N."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_lab.cpu import cascade, scaled_dot_product_attention
from mha_lab.cpu.cascade import cascade_attention, cascade_bytes, group_queries
from mha_lab.testing import assert_close


def plain(q, K_shared, V_shared, K_own, V_own):
    """Each request's query over the concatenation of the prefix and its own suffix."""
    out = []
    for i, (K, V) in enumerate(zip(K_own, V_own, strict=True)):
        K_all, V_all = np.concatenate([K_shared, K], axis=1), np.concatenate([V_shared, V], axis=1)  # (h_kv, P+S, d)
        out.append(scaled_dot_product_attention(q[i:i + 1], K_all[None], V_all[None], enable_gqa=True)[0])
    return np.concatenate(out)


def case(N, P, suffixes, h=4, h_kv=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((N, h, 1, d))
    K_shared, V_shared = rng.standard_normal((2, h_kv, P, d))
    K_shared *= 4  # the prefix's scores dominate some rows: the levels' maxima differ
    K_own = [rng.standard_normal((h_kv, s, d)) for s in suffixes]
    V_own = [rng.standard_normal((h_kv, s, d)) for s in suffixes]
    return q, K_shared, V_shared, K_own, V_own


@pytest.mark.parametrize(("N", "P", "suffixes", "h_kv"), [
    (1, 1, [1], 2), (3, 7, [1, 5, 2], 2), (5, 97, [3, 1, 9, 4, 7], 1), (2, 16, [16, 1], 4)])
def test_cascade_equals_plain_attention(N, P, suffixes, h_kv):
    args = case(N, P, suffixes, h_kv=h_kv, seed=P)
    assert_close(cascade_attention(*args), plain(*args))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 50), st.lists(st.integers(1, 9), min_size=4, max_size=4),
       st.sampled_from([1, 2, 4]), st.integers(0, 2**16))
def test_cascade_equals_plain_attention_for_any_sizes(B, L_pre, own, h_kv, seed):
    args = case(B, L_pre, own[:B], h_kv=h_kv, seed=seed)
    assert_close(cascade_attention(*args), plain(*args))


def test_merging_the_levels_without_rescaling_is_wrong(monkeypatch):
    def unscaled(m, l, acc):  # adds the levels' sums taken against different maxima
        return acc.sum(axis=0) / l.sum(axis=0), None

    args = case(3, 40, [2, 6, 3])
    monkeypatch.setattr(cascade, "merge_partials", unscaled)
    assert not np.allclose(cascade_attention(*args), plain(*args))


def test_queries_are_grouped_by_the_kv_head_they_read():
    q = np.arange(3 * 4 * 1 * 2.0).reshape(3, 4, 1, 2)  # (N, h, 1, d)
    g = group_queries(q, 2)  # (h_kv, N * 2, d)
    assert g.shape == (2, 6, 2)
    assert np.array_equal(g[1, 2], q[1, 2, 0]) and np.array_equal(g[0, 5], q[2, 1, 0])
    with pytest.raises(ValueError, match="multiple"):
        group_queries(q, 3)


def test_bytes_against_the_number_of_requests():
    one = cascade_bytes(1, 1000, 10, num_heads=8, num_kv_heads=2, head_dim=64)
    kv_row = 2 * 2 * 64 * 2
    assert one["plain"] == 1010 * kv_row and one["cascade"] == 1010 * kv_row + 4 * 8 * 65 * 4
    many = cascade_bytes(64, 1000, 10, num_heads=8, num_kv_heads=2, head_dim=64)
    assert many["plain"] == 64 * 1010 * kv_row
    assert many["cascade"] == (1000 + 64 * 10) * kv_row + 4 * 64 * 8 * 65 * 4  # the prefix read once, not 64 times


def test_the_prefix_is_read_once_for_all_requests(monkeypatch):
    """The keys cascade_attention hands to the softmax: the prefix once, then each suffix."""
    read = []
    partials = cascade.split_k_partials

    def spy(q, K, V, num_splits):
        read.append(K.shape[-2])
        return partials(q, K, V, num_splits)

    monkeypatch.setattr(cascade, "split_k_partials", spy)
    cascade_attention(*case(5, 40, [2, 6, 3, 1, 4]))
    assert read == [40, 2, 6, 3, 1, 4]  # 56 key rows, where plain attention reads 5 * 40 + 16
