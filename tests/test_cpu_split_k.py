"""Split-K decoding: merging the chunks' partial softmax states gives the full softmax; the program counts."""

import numpy as np
import pytest

from mha_lab.cpu import scaled_dot_product_attention
from mha_lab.cpu.split_k import (
    decode_programs,
    merge_partials,
    num_splits_heuristic,
    split_k_attention,
    split_k_partials,
)
from mha_lab.testing import assert_close


@pytest.mark.parametrize(("T", "splits"), [(1, 1), (7, 2), (7, 7), (97, 5), (256, 2), (256, 5)])
def test_split_k_equals_the_full_softmax(T, splits):
    rng = np.random.default_rng(T)
    q = rng.standard_normal((2, 3, 1, 8))
    K, V = rng.standard_normal((2, 3, T, 8)) * 3, rng.standard_normal((2, 3, T, 5))
    want, A = scaled_dot_product_attention(q, K, V)
    assert_close(split_k_attention(q, K, V, splits), want)
    _, lse = merge_partials(*split_k_partials(q, K, V, splits))
    scores = q @ K.swapaxes(-1, -2) / np.sqrt(8)
    assert_close(lse, np.log(np.exp(scores).sum(-1, keepdims=True)))


def test_merging_without_the_max_is_wrong_when_the_chunks_differ():
    rng = np.random.default_rng(0)
    q, K, V = rng.standard_normal((1, 1, 4)), rng.standard_normal((40, 4)), rng.standard_normal((40, 3))
    K[:20] *= 6  # the first chunk's scores are far larger
    m, l, acc = split_k_partials(q, K, V, 2)
    naive = (acc / l).mean(axis=0)  # averaging the chunks' outputs ignores their weights
    assert not np.allclose(naive, split_k_attention(q, K, V, 2))


def test_a_chunk_may_not_be_empty():
    with pytest.raises(ValueError, match="num_splits"):
        split_k_attention(np.ones((1, 2)), np.ones((3, 2)), np.ones((3, 2)), 4)


def test_split_counts_on_an_h100():
    # batch 1, 32 heads, 32k tokens: FlashAttention-2's grid fills 32 of the 2 x 132 program slots
    c = decode_programs(batch=1, heads=32, seq_len=32768, num_sms=132, block_n=128)
    assert c["slots"] == 264 and c["flash2"] == 32 and c["flash2_busy"] == pytest.approx(32 / 264)
    # 8 splits would fill 256 of 264 slots (97%), but 7 (224, 85%) is within 85% of that best and fewer
    assert c["splits"] == 7 and c["split_k"] == 224 and c["split_k_busy"] == pytest.approx(224 / 264)
    # batch 8: 256 programs already fill 80% of the slots, so no split
    c8 = decode_programs(batch=8, heads=32, seq_len=32768, num_sms=132, block_n=128)
    assert c8["splits"] == 1 and c8["split_k"] == 256
    # one program per SM (the heuristic given the bare SM count) splits less
    assert decode_programs(1, 32, 32768, num_sms=132, block_n=128, programs_per_sm=1)["splits"] == 4
    assert num_splits_heuristic(programs=128, num_sms=132, num_key_blocks=256) == 1
    # one program: efficiency n/132; of 87..128 splits only 128 changes the chunk size (2 blocks each)
    assert num_splits_heuristic(programs=1, num_sms=132, num_key_blocks=256) == 128
