"""Automatic prefix caching: chained block hashes, reuse of the cached blocks (exact against computing the
prompt afresh), least-recently-used eviction of free blocks, and the hit rate of a shared-prompt workload."""

import hashlib

import numpy as np
import pytest

from mha_lab.cpu import GroupedQueryAttention, create_causal_mask, scaled_dot_product_attention
from mha_lab.cpu import prefix_cache as pc
from mha_lab.cpu.prefix_cache import (
    PrefixCachedKV,
    PrefixCachingAllocator,
    block_hashes,
    shared_prompt_workload,
)
from mha_lab.testing import assert_close

LAYER = GroupedQueryAttention(d_model=24, num_heads=4, num_kv_heads=2, seed=3)  # d_k = 6
EMBED, POS = np.random.default_rng(0).standard_normal((2, 50, 24))  # token id, position -> (d_model,)


def embed(tokens):
    """(n,) token ids -> (1, n, d_model): a token's key depends on its position too."""
    return (EMBED[np.asarray(tokens)] + POS[:len(tokens)])[None]


def kv_of(tokens):
    """The layer's keys and values of a token sequence: (h_kv, n, d_k) each."""
    _, K, V = LAYER.project_qkv(embed(tokens))
    return K[0], V[0]


def serve(cache, prompt):
    """Admit a prompt, compute only what was not cached, return (seq, positions reused)."""
    seq, hit = cache.add_request(prompt)
    K, V = kv_of(prompt)
    cache.extend(seq, prompt[hit:], K[:, hit:], V[:, hit:])
    return seq, hit


def new_cache(num_blocks=32, block_size=4):
    return PrefixCachedKV(PrefixCachingAllocator(num_blocks, block_size, LAYER.num_kv_heads, LAYER.d_k))


def test_a_block_hash_chains_its_parent():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # the partial third block has no hash
    assert a[1] != b[1]  # same tokens in block 1, different prefix before it
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert a[0] == hashlib.sha256(pc.ROOT_HASH + np.array([1, 2, 3, 4], dtype=np.int64).tobytes()).digest()


def reused_keys_are_exact(cache):
    """The second prompt opens with the first's block 1; the third repeats the first's prefix."""
    prompts = [[1, 2, 3, 4, 9, 9, 9, 9, 5], [9, 9, 9, 9, 1, 2, 3, 4, 6], [1, 2, 3, 4, 9, 9, 9, 9, 8, 8]]
    hits = []
    for p in prompts:
        seq, hit = serve(cache, p)
        hits.append(hit)
        K, V = cache.gather(seq)
        want_K, want_V = kv_of(p)
        if not (np.allclose(K, want_K, rtol=1e-10, atol=1e-12) and np.allclose(V, want_V, rtol=1e-10, atol=1e-12)):
            return False
    assert hits[2] == 8  # the third reuses both blocks of the first
    return True


def test_reused_blocks_hold_the_prompts_own_keys():
    assert reused_keys_are_exact(new_cache())


def test_a_hash_without_the_parent_reuses_another_prompts_block(monkeypatch):
    def unchained(tokens, block_size, parent=pc.ROOT_HASH):
        ids = np.asarray(tokens, dtype=np.int64)
        return [hashlib.sha256(ids[i * block_size:(i + 1) * block_size].tobytes()).digest()
                for i in range(len(ids) // block_size)]

    monkeypatch.setattr(pc, "block_hashes", unchained)
    assert not reused_keys_are_exact(new_cache())


def test_attention_through_the_cached_prefix_equals_the_prompt_afresh():
    rng = np.random.default_rng(1)
    system = rng.integers(0, 50, 13).tolist()
    cache = new_cache(block_size=3)
    serve(cache, system + [4, 5])
    prompt = system + rng.integers(0, 50, 7).tolist()  # 20 tokens: 12 cached (4 blocks), 8 computed
    seq, hit = serve(cache, prompt)
    assert hit == 12
    X = embed(prompt)
    Q, _, _ = LAYER.project_qkv(X)
    K, V = cache.gather(seq)
    got, _ = scaled_dot_product_attention(Q, K[None], V[None], create_causal_mask(20), enable_gqa=True)
    assert_close(LAYER.project_out(got), LAYER.forward(X, mask=create_causal_mask(20)))


def test_the_last_prompt_token_is_always_computed():
    cache = new_cache()
    serve(cache, list(range(8)))
    _, hit = cache.add_request(list(range(8)))  # fully cached, but its last token must run
    assert hit == 4


def test_free_blocks_stay_findable_and_the_least_recently_freed_go_first():
    cache = new_cache(num_blocks=6, block_size=2)
    a, _ = serve(cache, [1, 2, 3, 4, 5])  # blocks 0, 1 full, 2 partial
    b, _ = serve(cache, [6, 7, 8, 9, 0])  # blocks 3, 4, 5
    cache.free_sequence(a)
    cache.free_sequence(b)
    pool = cache.allocator
    assert pool.used == 0 and len(pool.by_hash) == 4
    # tails are freed first: cached blocks queue as a's 1, 0 then b's 4, 3; the partial blocks
    # 2 and 5 hold nothing findable and go to the front
    assert pool.free == [5, 2, 1, 0, 4, 3]
    _, hit = serve(cache, [1, 2, 3, 4, 7, 7])  # reuses 0 and 1, then takes 5 for its own block
    assert hit == 4 and pool.evictions == 0
    c, _ = serve(cache, [8, 8, 8])  # takes 2 (no hash), then 4, the least recently freed cached block: b's tail
    assert pool.evictions == 1 and 4 not in pool.hash_of and cache.tables[c] == [2, 4]
    cache.free_sequence(c)
    _, hit = serve(cache, [6, 7, 8, 9, 1])  # b's head block is still cached
    assert hit == 2


def test_a_pool_of_referenced_blocks_is_full():
    cache = new_cache(num_blocks=2, block_size=2)
    serve(cache, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="out of KV blocks"):
        serve(cache, [5, 6, 7])


def test_one_system_prompt_is_computed_once():
    stats = shared_prompt_workload(num_requests=30, num_system=1, system_len=64, user_len=(1, 8), output_len=24,
                                   block_size=16, num_blocks=24, concurrent=4, seed=2)
    assert stats.hit_tokens == 29 * 64 and stats.blocks_saved == 29 * 4 and stats.evictions > 0
    assert stats.hit_rate == pytest.approx(29 * 64 / stats.prompt_tokens)
