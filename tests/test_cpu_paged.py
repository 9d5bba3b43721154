"""The paged KV cache: decoding through block tables equals the contiguous cache; prefix sharing with
reference counts and copy-on-write; the memory it holds against a contiguous allocator."""

import numpy as np
import pytest

from mha_lab.cpu import GroupedQueryAttention, KVCache, decode_step
from mha_lab.cpu.paged import (
    BlockAllocator,
    PagedKVCache,
    contiguous_footprint,
    pack_sequences,
    paged_decode_step,
)
from mha_lab.cpu.positions import RotaryAttention
from mha_lab.testing import assert_close

D_MODEL, H, H_KV = 24, 4, 2  # d_k = 6


def paged_cache(layer, num_blocks=64, block_size=4):
    return PagedKVCache(BlockAllocator(num_blocks, block_size, layer.num_kv_heads, layer.d_k))


@pytest.mark.parametrize("layer", [GroupedQueryAttention(D_MODEL, H, H_KV, seed=1),
                                   RotaryAttention(D_MODEL, H, H_KV, seed=2)], ids=["GQA", "RoPE"])
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_paged_decoding_equals_the_contiguous_cache(layer, block_size):
    B, T = 3, 13
    X = np.random.default_rng(block_size).standard_normal((B, T, D_MODEL))
    contiguous = KVCache.for_layer(layer, B, max_len=T)
    paged = paged_cache(layer, block_size=block_size)
    seqs = [paged.add_sequence() for _ in range(B)]
    for t in range(T):
        want = decode_step(layer, X[:, t:t + 1], contiguous)
        assert_close(paged_decode_step(layer, X[:, t:t + 1], paged, seqs), want, err_msg=f"token {t}")
    for b, s in enumerate(seqs):
        k, v = paged.gather(s)
        assert_close(k, contiguous.keys[b])
        assert_close(v, contiguous.values[b])
        assert len(paged.tables[s]) == -(-T // block_size)


def test_sequences_of_different_lengths_decode_together():
    layer = GroupedQueryAttention(D_MODEL, H, H_KV, seed=3)
    rng = np.random.default_rng(0)
    paged = paged_cache(layer)
    long, short = paged.add_sequence(), paged.add_sequence()
    prompt = rng.standard_normal((1, 9, D_MODEL))
    for t in range(9):  # only the first sequence has a prompt
        paged_decode_step(layer, prompt[:, t:t + 1], paged, [long])
    x = rng.standard_normal((2, 1, D_MODEL))
    got = paged_decode_step(layer, x, paged, [long, short])
    alone = KVCache.for_layer(layer, 1, max_len=10)
    for t in range(9):
        decode_step(layer, prompt[:, t:t + 1], alone)
    assert_close(got[:1], decode_step(layer, x[:1], alone))
    assert_close(got[1:], decode_step(layer, x[1:], KVCache.for_layer(layer, 1, max_len=1)))
    assert paged.lengths == {long: 10, short: 1}


def test_a_forked_sequence_shares_the_prompt_and_copies_on_write():
    layer = GroupedQueryAttention(D_MODEL, H, H_KV, seed=4)
    rng = np.random.default_rng(1)
    paged = paged_cache(layer, num_blocks=8, block_size=4)
    parent = paged.add_sequence()
    prompt = rng.standard_normal((1, 6, D_MODEL))  # 6 tokens: one full block, one half-full
    for t in range(6):
        paged_decode_step(layer, prompt[:, t:t + 1], paged, [parent])
    child = paged.add_sequence(parent=parent)
    a = paged.allocator
    assert paged.tables[child] == paged.tables[parent] and a.used == 2
    assert list(a.refcount[paged.tables[parent]]) == [2, 2]

    x = rng.standard_normal((2, 1, D_MODEL))  # the two continue differently
    got = paged_decode_step(layer, x, paged, [parent, child])
    # the shared half-full block was copied for the first writer; the full one stays shared
    assert paged.tables[parent][0] == paged.tables[child][0] and a.refcount[paged.tables[parent][0]] == 2
    assert paged.tables[parent][1] != paged.tables[child][1] and a.used == 3
    assert list(a.refcount[[paged.tables[parent][1], paged.tables[child][1]]]) == [1, 1]
    for b in range(2):  # each equals its own contiguous decoding of prompt + its token
        alone = KVCache.for_layer(layer, 1, max_len=7)
        for t in range(6):
            decode_step(layer, prompt[:, t:t + 1], alone)
        assert_close(got[b:b + 1], decode_step(layer, x[b:b + 1], alone))
    paged.free_sequence(parent)
    assert a.refcount[paged.tables[child][0]] == 1 and a.used == 2
    paged.free_sequence(child)
    assert a.used == 0 and sorted(a.free) == list(range(8))


def test_the_pool_runs_out_with_a_clear_error():
    layer = GroupedQueryAttention(D_MODEL, H, H_KV, seed=5)
    paged = paged_cache(layer, num_blocks=2, block_size=2)
    s = paged.add_sequence()
    k = np.zeros((H_KV, 4, D_MODEL // H))
    paged.append(s, k, k)
    with pytest.raises(ValueError, match="out of KV blocks"):
        paged.append(s, k[:, :1], k[:, :1])
    with pytest.raises(ValueError, match="no sequence 7"):
        paged.gather(7)


def test_paged_memory_wastes_less_than_a_block_per_sequence():
    layer = GroupedQueryAttention(D_MODEL, H, H_KV, seed=6)
    lengths, block_size, max_len = [5, 17, 64, 3, 30], 8, 64
    paged = paged_cache(layer, num_blocks=32, block_size=block_size)
    k = np.zeros((H_KV, max_len, D_MODEL // H))
    for n in lengths:
        paged.append(paged.add_sequence(), k[:, :n], k[:, :n])
    fp = paged.footprint()
    assert fp.tokens == sum(lengths)
    assert fp.slots == block_size * sum(-(-n // block_size) for n in lengths)
    assert fp.slots - fp.tokens < block_size * len(lengths)
    contiguous = contiguous_footprint(lengths, max_len)
    assert contiguous.slots == len(lengths) * max_len and contiguous.waste > fp.waste
    assert fp.waste == pytest.approx(1 - 119 / 136)


def test_packed_sequences_read_back_through_their_tables():
    rng = np.random.default_rng(7)
    keys = [rng.standard_normal((2, n, 3)) for n in (5, 0, 9)]
    values = [rng.standard_normal((2, n, 3)) for n in (5, 0, 9)]
    k_pool, v_pool, tables, lengths = pack_sequences(keys, values, block_size=4, capacity=10, seed=1)
    assert tables.shape == (3, 3) and sorted(tables.ravel()) == list(range(9)) and lengths.tolist() == [5, 0, 9]
    for b, n in enumerate(lengths):
        for pool, want in ((k_pool, keys[b]), (v_pool, values[b])):
            read = pool[tables[b]].transpose(1, 0, 2, 3).reshape(2, -1, 3)  # (h_kv, 12, d_k)
            np.testing.assert_array_equal(read[:, :n], want)
            assert not np.any(read[:, n:] == 0)  # the unused slots hold noise, not zeros
    with pytest.raises(ValueError, match="longer than the capacity"):
        pack_sequences(keys, values, block_size=4, capacity=8)


def test_truncating_returns_the_blocks_past_the_new_end():
    layer = GroupedQueryAttention(D_MODEL, H, H_KV, seed=4)
    cache = paged_cache(layer, num_blocks=8, block_size=4)
    seq = cache.add_sequence()
    k = np.random.default_rng(0).standard_normal((H_KV, 10, layer.d_k))
    cache.append(seq, k, k)
    cache.truncate(seq, 5)  # 10 positions in 3 blocks -> 5 in 2
    assert cache.lengths[seq] == 5 and len(cache.tables[seq]) == 2 and cache.allocator.used == 2
    cache.append(seq, k[:, 7:9], k[:, 7:9])
    assert_close(cache.gather(seq)[0], np.concatenate([k[:, :5], k[:, 7:9]], axis=1))
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(seq, 8)
