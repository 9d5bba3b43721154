"""Context parallelism in NumPy and its formulas: the zigzag split, the ring's schedule, ring attention
over simulated ranks against plain attention, the bytes of the ring and of Ulysses."""

from __future__ import annotations

import numpy as np
import pytest

from mha_lab.cpu import create_causal_mask, scaled_dot_product_attention
from mha_lab.parallel.cost import ring_bytes, ulysses_bytes
from mha_lab.parallel.sequence import (
    rank_partials,
    ring_attention,
    ring_part,
    ring_source,
    shard_sequence,
    unshard_sequence,
    zigzag_chunks,
)
from mha_lab.testing import assert_close


def _qkv(seed, B, h, L, d, scale=1.0):
    rng = np.random.default_rng(seed)
    return scale * rng.standard_normal((B, h, L, d)), rng.standard_normal((B, h, L, d)), rng.standard_normal(
        (B, h, L, d))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_equals_plain_attention(n, causal):
    Q, K, V = _qkv(n, 3, 2, 12 * (2 if causal else 1), 5)
    L = Q.shape[-2]
    expected = scaled_dot_product_attention(Q, K, V, create_causal_mask(L) if causal else None)[0]
    assert_close(ring_attention(Q, K, V, n, causal), expected)


def test_ring_attention_with_scores_in_the_thousands():
    Q, K, V = _qkv(7, 2, 2, 16, 4, scale=500.0)
    for causal in (False, True):
        out = ring_attention(Q, K, V, 4, causal)
        assert np.isfinite(out).all()
        assert_close(out, scaled_dot_product_attention(Q, K, V, create_causal_mask(16) if causal else None)[0])


def test_zigzag_split_pairs_an_early_chunk_with_a_late_one():
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = np.arange(16)[:, None]  # (L, 1): each row its position
    blocks = shard_sequence(x, 4, zigzag=True)
    assert [b[:, 0].tolist() for b in blocks] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert np.array_equal(unshard_sequence(blocks, zigzag=True), x)
    assert np.array_equal(unshard_sequence(shard_sequence(x, 4), zigzag=False), x)


def test_causal_zigzag_gives_every_rank_the_same_work_at_every_step():
    """Query-key pairs each rank computes at each step (c positions a chunk): equal over the ranks."""
    n, c = 4, 3
    pairs = {"causal": 2 * c * (2 * c + 1) // 2, "first keys": 2 * c * c, "second queries": c * 2 * c}
    for step in range(n):
        parts = [ring_part(n, r, step, causal=True) for r in range(n)]
        assert set(parts) <= ({"causal"} if step == 0 else {"first keys", "second queries"})
        assert len({pairs[p] for p in parts}) == 1, parts
        # a block from a lower rank: its early chunk precedes both query chunks, its late one follows them
        assert all((ring_source(n, r, step) < r) == (p == "first keys") for r, p in enumerate(parts) if step)
    assert {ring_part(n, r, s, False) for r in range(n) for s in range(n)} == {"all"}


def test_ring_source_passes_blocks_forward():
    assert [ring_source(4, 1, s) for s in range(4)] == [1, 0, 3, 2]


def test_partial_states_are_unnormalised_and_merge_to_the_answer():
    Q, K, V = _qkv(3, 2, 2, 8, 4)
    Ks, Vs = shard_sequence(K, 2), shard_sequence(V, 2)
    m, l, acc = rank_partials(shard_sequence(Q, 2)[1], Ks, Vs, 1)
    s = Q[..., 4:, :] @ np.swapaxes(K, -1, -2) / 2.0  # (B, h, 4, 8): rank 1's rows, all keys, scaled
    assert_close(m, s.max(-1, keepdims=True))
    assert_close(l, np.exp(s - m).sum(-1, keepdims=True))
    assert_close(acc / l, scaled_dot_product_attention(Q, K, V)[0][..., 4:, :])


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="sequence length 10 does not split into 8 equal chunks"):
        shard_sequence(np.zeros((10, 2)), 4, zigzag=True)
    with pytest.raises(ValueError, match="rank=4 is outside 0..3"):
        zigzag_chunks(4, 4)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        ring_attention(*_qkv(0, 1, 1, 4, 2), 0)


def test_ring_and_ulysses_bytes_formulas():
    B, L, h, h_kv, d, n = 2, 64, 8, 2, 16, 4
    block = 2 * B * h_kv * (L // n) * d * 2  # K and V of one block, bfloat16
    assert ring_bytes(B, L, h_kv, d, n) == {"K/V forward": 3 * block, "K/V backward": 3 * block,
                                            "dK/dV backward": 4 * block}
    assert ring_bytes(B, L, h_kv, d, 1) == {"K/V forward": 0, "K/V backward": 0, "dK/dV backward": 0}
    sent = B * (L // n) * d * (2 * h + 2 * h_kv) * 3 // 4 * 4  # float32: 3/4 of each block leaves the rank
    assert ulysses_bytes(B, L, h, h_kv, d, n, "float32") == {"all-to-all forward": sent, "all-to-all backward": sent}
    with pytest.raises(ValueError, match="seq_len=63 does not split into 4 equal blocks"):
        ring_bytes(B, 63, h_kv, d, n)
