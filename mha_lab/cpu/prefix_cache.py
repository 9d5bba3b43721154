r"""Automatic prefix caching (vLLM's), in NumPy: full blocks found again by the hash of everything before them.

A paged cache shares a prompt's blocks only between sequences forked from one another. A
server also meets requests that merely *begin* alike (a system prompt, the turns of a chat)
without knowing it. vLLM names every **full** block by a hash that chains its parent's hash
and its own tokens,

.. math:: h_0 = H(\varnothing, t_{0:b}), \qquad h_i = H(h_{i-1}, t_{ib:(i+1)b}),

so equal hashes mean equal prefixes, not merely equal blocks. A new request looks its blocks'
hashes up in order and reuses every block found until the first miss; it computes only the
rest. A block whose last reference goes stays in the pool with its hash, free but still
findable, until the pool needs it: free blocks are handed out least recently freed first, and a
request frees its blocks last to first, so a prefix's tail is evicted before its head. A freed
block with no hash (a partly filled last block) holds nothing findable and goes first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from mha_lab.cpu.paged import BlockAllocator, PagedKVCache

__all__ = ["ROOT_HASH", "block_hashes", "PrefixCachingAllocator", "PrefixCachedKV", "PrefixStats",
           "shared_prompt_workload"]

ROOT_HASH = b"\x00" * 32
"""The parent hash of a sequence's first block (vLLM draws it at random per process)."""


def block_hashes(tokens: list[int] | np.ndarray, block_size: int,
                 parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained SHA-256 of each full block: ``h_i = H(h_{i-1} || block i's tokens)``.

    A partial last block has no hash: its contents may still change.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    ids = np.asarray(tokens, dtype=np.int64)
    out = []
    for i in range(len(ids) // block_size):
        block = ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        out.append(parent)
    return out


class PrefixCachingAllocator(BlockAllocator):
    """A ``BlockAllocator`` whose full blocks keep their hash while free, evicted least recently used.

    ``free`` is kept in LRU order: released blocks with a hash join the end, those without one
    the front; ``allocate`` takes the front and forgets that block's hash (an **eviction** when
    it had one).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: np.dtype | type = np.float64) -> None:
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        self.free.reverse()  # the front of the queue is handed out first: block 0
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictions = 0

    def allocate(self) -> int:
        """The least recently freed block, its cached contents forgotten; ValueError when none is free."""
        if not self.free:
            raise ValueError(f"out of KV blocks: all {self.num_blocks} are referenced by running sequences")
        block = self.free.pop(0)
        if block in self.hash_of:
            del self.by_hash[self.hash_of.pop(block)]
            self.evictions += 1
        self.refcount[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; a block left free joins the queue's end, or its front without a hash."""
        super().release(block)
        if self.refcount[block] == 0 and block not in self.hash_of:
            self.free.insert(0, self.free.pop())  # nothing in it can be found: reuse it first

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the prefix named by ``block_hash``, used or free, or None."""
        return self.by_hash.get(block_hash)

    def reuse(self, block: int) -> int:
        """One more reference to a cached block; a free one leaves the eviction queue."""
        if self.refcount[block] == 0:
            self.free.remove(block)
        self.refcount[block] += 1
        return block

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by its hash (the first block with that hash keeps it)."""
        if block_hash not in self.by_hash:
            self.by_hash[block_hash] = block
            self.hash_of[block] = block_hash


class PrefixCachedKV(PagedKVCache):
    """A ``PagedKVCache`` over a ``PrefixCachingAllocator``: requests start from the cached blocks of their prompt.

    ``tokens[s]`` are the token ids whose keys and values sequence s holds.
    """

    def __init__(self, allocator: PrefixCachingAllocator) -> None:
        if not isinstance(allocator, PrefixCachingAllocator):
            raise TypeError(f"a PrefixCachedKV needs a PrefixCachingAllocator, got {type(allocator).__name__}")
        super().__init__(allocator)
        self.allocator: PrefixCachingAllocator = allocator
        self.tokens: dict[int, list[int]] = {}
        self.hashes: dict[int, list[bytes]] = {}

    def add_request(self, prompt: list[int] | np.ndarray) -> tuple[int, int]:
        """A new sequence holding the longest cached prefix of ``prompt``.

        Returns (seq, positions reused). At most ``len(prompt) - 1`` positions are
        reused: the prompt's last token is always computed, since its output gives
        the first new token.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        seq = self.add_sequence()
        a, table = self.allocator, self.tables[seq]
        hashes = self.hashes.setdefault(seq, [])
        usable = (len(prompt) - 1) // a.block_size
        for h in block_hashes(prompt[:usable * a.block_size], a.block_size):
            block = a.lookup(h)
            if block is None:
                break
            table.append(a.reuse(block))
            hashes.append(h)
        self.lengths[seq] = len(table) * a.block_size
        self.tokens[seq] = prompt[:self.lengths[seq]]
        return seq, self.lengths[seq]

    def extend(self, seq: int, tokens: list[int] | np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Append the keys and values (h_kv, n, d_k) of n ``tokens``; every block they fill becomes findable."""
        tokens = [int(t) for t in tokens]
        if len(tokens) != k.shape[1]:
            raise ValueError(f"{len(tokens)} tokens but keys for {k.shape[1]} positions")
        self.append(seq, k, v)
        self.tokens[seq].extend(tokens)
        bs, hashes = self.allocator.block_size, self.hashes[seq]
        done = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        for i, h in enumerate(block_hashes(self.tokens[seq][done * bs:], bs, parent), start=done):
            self.allocator.register(self.tables[seq][i], h)
            hashes.append(h)

    def free_sequence(self, seq: int) -> None:
        """Release the blocks of ``seq`` last to first, so that its tail is evicted before its head."""
        self._check(seq)
        self.tables[seq].reverse()
        super().free_sequence(seq)
        del self.tokens[seq], self.hashes[seq]


@dataclass(frozen=True)
class PrefixStats:
    """What a workload reused: prompt tokens, those found cached, blocks not recomputed, evictions."""

    prompt_tokens: int
    hit_tokens: int
    blocks_saved: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Share of the prompt tokens whose keys and values came from the cache."""
        return self.hit_tokens / self.prompt_tokens


def shared_prompt_workload(num_requests: int = 200, num_system: int = 4, system_len: int = 512,
                           user_len: tuple[int, int] = (16, 128), output_len: int = 32, vocab: int = 32000,
                           block_size: int = 16, num_blocks: int = 512, concurrent: int = 8,
                           seed: int = 0) -> PrefixStats:
    """Serve requests that each open with one of a few system prompts, and count what the cache reused.

    Each request is a system prompt drawn uniformly from ``num_system``, a user turn of random
    tokens, and ``output_len`` generated tokens; ``concurrent`` requests are alive at once, the
    oldest finishing when a new one arrives. Keys and values are zeros of one number each: what
    is reused depends only on the tokens and the pool.
    """
    rng = np.random.default_rng(seed)
    systems = rng.integers(0, vocab, size=(num_system, system_len))
    cache = PrefixCachedKV(PrefixCachingAllocator(num_blocks, block_size, num_kv_heads=1, head_dim=1))
    alive: list[int] = []
    prompt_tokens = hit_tokens = 0
    for _ in range(num_requests):
        if len(alive) == concurrent:
            cache.free_sequence(alive.pop(0))
        user = rng.integers(0, vocab, size=rng.integers(user_len[0], user_len[1] + 1))
        prompt = np.concatenate([systems[rng.integers(num_system)], user])
        seq, hit = cache.add_request(prompt)
        new = np.concatenate([prompt[hit:], rng.integers(0, vocab, size=output_len)])
        zeros = np.zeros((1, len(new), 1))  # (h_kv, n, d_k)
        cache.extend(seq, new, zeros, zeros)
        alive.append(seq)
        prompt_tokens, hit_tokens = prompt_tokens + len(prompt), hit_tokens + hit
    return PrefixStats(prompt_tokens, hit_tokens, hit_tokens // block_size, cache.allocator.evictions)
