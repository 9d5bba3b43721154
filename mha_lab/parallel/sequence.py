r"""Context parallelism simulated in NumPy: the sequence split over N pretend ranks, and ring attention.

A sequence too long for one device is cut along L. Rank r keeps its own block of queries; the
key/value blocks travel round a ring, rank r handing its current block to rank r+1 and receiving
one from rank r-1, so at step s it holds the block that rank :math:`(r - s) \bmod N` started with.
Its queries keep the online softmax's running state (m, l, acc) across the steps, exactly as a
tiled forward does across key tiles, and are normalised once, after the N-th block:

.. math:: o = \mathrm{acc} / \ell

With a causal mask a contiguous split gives rank 0 one block of work and rank N-1 N blocks. The
zigzag split cuts L into 2N chunks and gives rank r chunks r and 2N-1-r: one early and one late,
so every rank does the same work at every step (``ring_part``). This module decides who holds
what; the ring on ``torch.distributed`` (``mha_lab.parallel.context``) imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["zigzag_chunks", "shard_sequence", "unshard_sequence", "ring_source", "ring_part", "block_state",
           "merge_states", "rank_partials", "ring_attention"]

def _check_ranks(world_size: int, rank: int | None = None) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")


def zigzag_chunks(world_size: int, rank: int) -> tuple[int, int]:
    """The two of the 2N chunks of the sequence that ``rank`` holds in the zigzag split: r and 2N-1-r."""
    _check_ranks(world_size, rank)
    return rank, 2 * world_size - 1 - rank


def shard_sequence(x: np.ndarray, world_size: int, zigzag: bool = False, axis: int = -2) -> list[np.ndarray]:
    """Cut ``x`` along ``axis`` (the sequence) into one block per rank: contiguous, or zigzag.

    Shapes: x (..., L, d) -> N blocks (..., L/N, d). L must divide into N blocks (2N chunks for zigzag).
    """
    _check_ranks(world_size)
    L, parts = x.shape[axis], 2 * world_size if zigzag else world_size
    if L % parts:
        raise ValueError(f"sequence length {L} does not split into {parts} equal chunks "
                         f"({world_size} ranks{', two chunks each (zigzag)' if zigzag else ''})")
    chunks = np.split(x, parts, axis=axis)
    if not zigzag:
        return chunks
    return [np.concatenate([chunks[i] for i in zigzag_chunks(world_size, r)], axis=axis) for r in range(world_size)]


def unshard_sequence(blocks: Sequence[np.ndarray], zigzag: bool = False, axis: int = -2) -> np.ndarray:
    """The inverse of ``shard_sequence``: the blocks of the N ranks back in sequence order."""
    if not zigzag:
        return np.concatenate(blocks, axis=axis)
    n = len(blocks)
    chunks = [None] * (2 * n)
    for r, block in enumerate(blocks):
        for i, part in zip(zigzag_chunks(n, r), np.split(block, 2, axis=axis), strict=True):
            chunks[i] = part
    return np.concatenate(chunks, axis=axis)


def ring_source(world_size: int, rank: int, step: int) -> int:
    """The rank whose key/value block ``rank`` holds at ``step``: :math:`(r - s) \\bmod N`."""
    _check_ranks(world_size, rank)
    return (rank - step) % world_size


def ring_part(world_size: int, rank: int, step: int, causal: bool) -> str:
    """Which queries of ``rank`` meet which keys of the block it holds at ``step`` (zigzag split when causal).

    ``"all"``: every query, every key (no mask). Causal, zigzag: ``"causal"`` at step 0 (its own
    chunks, causal within them); ``"first keys"`` when the block came from a lower rank (both query
    chunks see its early chunk, neither its late one); ``"second queries"`` when it came from a higher
    rank (only the late query chunk sees it, all of it). Each of the last two is half a block's work.
    """
    source = ring_source(world_size, rank, step)
    if not causal:
        return "all"
    if step == 0:
        return "causal"
    return "first keys" if source < rank else "second queries"


def block_state(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""The online softmax's state of queries ``q`` over one key/value block.

    .. math:: s = q k^\top / \sqrt{d},\ m = \max_j s_j,\
              \ell = \sum_j e^{s_j - m},\ \mathrm{acc} = \sum_j e^{s_j - m} v_j

    Shapes: q (..., Lq, d); k, v (..., Lk, d) -> m, l (..., Lq, 1);
    acc (..., Lq, d). ``causal``: Lq = Lk and query i sees keys 0..i
    (a rank's own zigzag chunks, in their order). Not normalised.
    """
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # (..., Lq, Lk)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # (..., Lq, 1): a key for every row
    p = np.exp(s - m)
    return m, p.sum(axis=-1, keepdims=True), p @ v


def merge_states(m_a: np.ndarray, l_a: np.ndarray, acc_a: np.ndarray,
                 m_b: np.ndarray, l_b: np.ndarray, acc_b: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Two states of the same queries over different keys, as one.

    .. math:: m = \max(m_a, m_b),\ \ell = e^{m_a - m} \ell_a + e^{m_b - m} \ell_b,\
              \mathrm{acc} = e^{m_a - m} \mathrm{acc}_a + e^{m_b - m} \mathrm{acc}_b

    Shapes: m, l (..., L, 1); acc (..., L, d), both states alike.
    (``split_k.merge_partials`` merges S states at once and normalises;
    ``memory.online_softmax_step`` folds raw scores into a state.)
    """
    m = np.maximum(m_a, m_b)
    a, b = np.exp(m_a - m), np.exp(m_b - m)  # each rescaled to the larger max
    return m, a * l_a + b * l_b, a * acc_a + b * acc_b


def rank_partials(Q: np.ndarray, K_blocks: Sequence[np.ndarray],
                  V_blocks: Sequence[np.ndarray], rank: int,
                  causal: bool = False) -> tuple[np.ndarray, ...]:
    """Rank ``rank``'s state (m, l, acc) once the ring has brought it every block.

    Shapes: Q (B, h, L/N, d), its queries (zigzag order when causal);
    K_blocks, V_blocks: the N ranks' blocks (B, h, L/N, d), indexed by the
    rank that holds them first -> m, l (B, h, L/N, 1); acc (B, h, L/N, d).
    """
    n, half = len(K_blocks), Q.shape[-2] // 2
    # step 0: its own block
    m, l, acc = block_state(Q, K_blocks[rank], V_blocks[rank], causal)
    for step in range(1, n):
        source = ring_source(n, rank, step)
        part = ring_part(n, rank, step, causal)
        K, V = K_blocks[source], V_blocks[source]
        if part == "first keys":  # a lower rank: its early chunk only
            new = block_state(Q, K[..., :half, :], V[..., :half, :])
            m, l, acc = merge_states(m, l, acc, *new)
        elif part == "second queries":  # a higher rank: our late chunk only
            late = slice(half, None)
            new = block_state(Q[..., late, :], K, V)
            m[..., late, :], l[..., late, :], acc[..., late, :] = merge_states(
                m[..., late, :], l[..., late, :], acc[..., late, :], *new)
        else:
            m, l, acc = merge_states(m, l, acc, *block_state(Q, K, V))
    return m, l, acc


def ring_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, world_size: int,
                   causal: bool = False) -> np.ndarray:
    """Attention of the sequence by ring attention on ``world_size`` simulated ranks.

    Shapes: Q, K, V (B, h, L, d) -> (B, h, L, d); equals plain attention (with
    the causal mask when ``causal``, on the zigzag split: L divides into 2N).
    """
    blocks = [shard_sequence(x, world_size, zigzag=causal) for x in (Q, K, V)]
    outs = []
    for r in range(world_size):
        _, l, acc = rank_partials(blocks[0][r], blocks[1], blocks[2], r, causal)
        outs.append(acc / l)  # normalised once, after the last block
    return unshard_sequence(outs, zigzag=causal)
