r"""A paged KV cache (vLLM's PagedAttention, Kwon et al. 2023), in NumPy.

A contiguous cache reserves ``max_len`` slots per sequence up front, so a batch of short
sequences wastes most of what it holds. A paged cache cuts the memory into fixed-size
**blocks** (pages) of ``block_size`` positions, shared by every sequence, and gives each
sequence a **block table**: the list of its blocks in order. Position p of a sequence lives
in block ``table[p // block_size]`` at row ``p % block_size``. A sequence takes a new block
only when its last one is full, so at most ``block_size - 1`` slots per sequence are wasted.

Sequences that share a prompt share its blocks: each block has a **reference count**, and a
sequence that appends to a shared, partly filled block first copies it
(**copy-on-write**), so the others never see its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import check_rank, scaled_dot_product_attention

__all__ = ["BlockAllocator", "PagedKVCache", "paged_decode_step", "Footprint", "contiguous_footprint",
           "pack_sequences"]


class BlockAllocator:
    """A pool of ``num_blocks`` key and value blocks, each (h_kv, block_size, d_k), with reference counts.

    Shapes: ``k_pool``, ``v_pool`` (num_blocks, h_kv, block_size, d_k).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: np.dtype | type = np.float64) -> None:
        for name, n in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if n < 1:
                raise ValueError(f"{name} must be at least 1, got {n}")
        self.block_size = block_size
        shape = (num_blocks, num_kv_heads, block_size, head_dim)  # (N, h_kv, block_size, d_k)
        self.k_pool, self.v_pool = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.refcount = np.zeros(num_blocks, dtype=np.int64)
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first

    @property
    def num_blocks(self) -> int:
        return len(self.refcount)

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """A free block, now referenced once; ValueError when the pool is exhausted."""
        if not self.free:
            raise ValueError(f"out of KV blocks: all {self.num_blocks} are in use; free a sequence "
                             "or allocate a larger pool")
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more reference to ``block`` (a sequence forked from another)."""
        if self.refcount[block] < 1:
            raise ValueError(f"block {block} is free: only a used block can be shared")
        self.refcount[block] += 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; the block returns to the pool when none is left."""
        if self.refcount[block] < 1:
            raise ValueError(f"block {block} is already free")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)


class PagedKVCache:
    """Sequences of keys and values stored in the blocks of one ``BlockAllocator``.

    ``tables[s]`` is sequence s's block table, ``lengths[s]`` its number of positions.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_id = 0

    @classmethod
    def for_layer(cls, layer: GroupedQueryAttention, num_blocks: int, block_size: int) -> PagedKVCache:
        """An empty cache over a new pool of ``num_blocks`` blocks shaped for ``layer``'s key/value heads and dtype."""
        return cls(BlockAllocator(num_blocks, block_size, layer.num_kv_heads, layer.d_k, layer.dtype))

    def add_sequence(self, parent: int | None = None) -> int:
        """A new empty sequence, or (``parent``) one that shares every block of ``parent``; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        if parent is None:
            self.tables[seq], self.lengths[seq] = [], 0
        else:
            self._check(parent)
            self.tables[seq] = [self.allocator.share(b) for b in self.tables[parent]]
            self.lengths[seq] = self.lengths[parent]
        return seq

    def free_sequence(self, seq: int) -> None:
        """Release every block of ``seq`` and forget it."""
        self._check(seq)
        for block in self.tables.pop(seq):
            self.allocator.release(block)
        del self.lengths[seq]

    def _check(self, seq: int) -> None:
        if seq not in self.tables:
            raise ValueError(f"no sequence {seq} in the cache (known: {sorted(self.tables)})")

    def _writable_block(self, seq: int) -> int:
        """The block that position ``lengths[seq]`` goes to.

        A fresh block when the last one is full; the last one, copied first if shared.
        """
        table, a = self.tables[seq], self.allocator
        if self.lengths[seq] % a.block_size == 0:  # last block full, or none yet
            table.append(a.allocate())
        elif a.refcount[table[-1]] > 1:  # copy-on-write: others still read it
            old, new = table[-1], a.allocate()
            a.k_pool[new], a.v_pool[new] = a.k_pool[old], a.v_pool[old]
            a.release(old)
            table[-1] = new
        return table[-1]

    def append(self, seq: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write n new positions of sequence ``seq``; k and v (h_kv, n, d_k)."""
        self._check(seq)
        want = (self.allocator.k_pool.shape[1], self.allocator.k_pool.shape[3])
        if k.shape != v.shape or k.ndim != 3 or (k.shape[0], k.shape[2]) != want:
            raise ValueError(f"k and v must both be (h_kv, n, d_k) with (h_kv, d_k) = {want}; "
                             f"got {k.shape} and {v.shape}")
        for i in range(k.shape[1]):
            block = self._writable_block(seq)
            row = self.lengths[seq] % self.allocator.block_size
            self.allocator.k_pool[block, :, row] = k[:, i]
            self.allocator.v_pool[block, :, row] = v[:, i]
            self.lengths[seq] += 1

    def truncate(self, seq: int, length: int) -> None:
        """Forget the positions of ``seq`` from ``length`` on (rejected drafts).

        Blocks wholly past the new end go back to the pool; rows past it in the
        last kept block are overwritten by the next append (copied first if that
        block is shared).
        """
        self._check(seq)
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence {seq} of {self.lengths[seq]} "
                             f"positions to {length}")
        table, keep = self.tables[seq], -(-length // self.allocator.block_size)
        for block in table[keep:]:
            self.allocator.release(block)
        del table[keep:]
        self.lengths[seq] = length

    def gather(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of ``seq`` through its block table: (h_kv, T, d_k) each."""
        self._check(seq)
        table, T = self.tables[seq], self.lengths[seq]
        out = []
        for pool in (self.allocator.k_pool, self.allocator.v_pool):
            _, h_kv, bs, d_k = pool.shape
            # (n, h_kv, bs, d_k) -> (h_kv, n, bs, d_k) -> (h_kv, n * bs, d_k)
            rows = pool[table].transpose(1, 0, 2, 3)
            rows = rows.reshape(h_kv, len(table) * bs, d_k)
            out.append(rows[:, :T])  # the last block's unused rows dropped
        return out[0], out[1]

    def footprint(self) -> Footprint:
        """Positions stored and slots held (each shared block counted once)."""
        return Footprint(tokens=sum(self.lengths.values()), slots=self.allocator.used * self.allocator.block_size)


def paged_decode_step(layer: GroupedQueryAttention, x: np.ndarray, cache: PagedKVCache,
                      seqs: list[int]) -> np.ndarray:
    """One new token for each sequence in ``seqs``, attending through its block table.

    Shapes: x (B, 1, d_model) with B = len(seqs) -> (B, 1, d_model). Each token sits at position
    ``cache.lengths[s]`` (what a RoPE layer rotates by); its key and value are appended first,
    so it sees itself. Sequences may have different lengths.
    """
    check_rank("x", x, 3, "(B, 1, d_model)")
    if x.shape[:2] != (len(seqs), 1):
        raise ValueError(f"x must be (B, 1, d_model) with B = len(seqs) = {len(seqs)}, got {x.shape}")
    out = []
    for b, seq in enumerate(seqs):
        # (1, h, 1, d_k), (1, h_kv, 1, d_k) twice
        q, k, v = layer.project_qkv(x[b:b + 1], offset=cache.lengths[seq])
        cache.append(seq, k[0], v[0])
        K, V = cache.gather(seq)  # (h_kv, T, d_k)
        z, _ = scaled_dot_product_attention(q, K[None], V[None], enable_gqa=True)  # (1, h, 1, d_k)
        out.append(layer.project_out(z))  # (1, 1, d_model)
    return np.concatenate(out, axis=0)


@dataclass(frozen=True)
class Footprint:
    """A cache's positions stored (``tokens``) against the slots it holds (``slots``)."""

    tokens: int
    slots: int

    @property
    def waste(self) -> float:
        """Share of the held slots that store nothing."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def contiguous_footprint(lengths: list[int], max_len: int) -> Footprint:
    """What a contiguous cache holds for these sequences: ``max_len`` slots reserved for each."""
    if max(lengths) > max_len:
        raise ValueError(f"a sequence of {max(lengths)} positions does not fit max_len={max_len}")
    return Footprint(tokens=sum(lengths), slots=len(lengths) * max_len)


def pack_sequences(keys: list[np.ndarray], values: list[np.ndarray], block_size: int, capacity: int,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scatter per-sequence caches into one pool of blocks in shuffled order, as a busy server's pool looks.

    keys, values: one (h_kv, T_b, d_k) array per sequence. Each table covers ``capacity`` positions
    (rounded up to whole blocks, at least every T_b); slots that store nothing hold noise, so that
    reading past a sequence's end shows. Returns k_pool, v_pool (N, h_kv, block_size, d_k),
    block_tables (B, capacity / block_size) of ints and lengths (B,) = the T_b.
    """
    if max(k.shape[1] for k in keys) > capacity:
        raise ValueError(f"a sequence is longer than the capacity {capacity}")
    rng = np.random.default_rng(seed)
    per_seq = -(-capacity // block_size)
    h_kv, d_k = keys[0].shape[0], keys[0].shape[2]
    shape = (len(keys) * per_seq, h_kv, block_size, d_k)  # (N, h_kv, block_size, d_k)
    k_pool, v_pool = rng.standard_normal(shape), rng.standard_normal(shape)
    tables = rng.permutation(shape[0]).reshape(len(keys), per_seq)  # (B, blocks per sequence)
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        for p in range(k.shape[1]):
            k_pool[tables[b, p // block_size], :, p % block_size] = k[:, p]
            v_pool[tables[b, p // block_size], :, p % block_size] = v[:, p]
    return k_pool, v_pool, tables, np.array([k.shape[1] for k in keys])
