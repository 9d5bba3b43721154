"""Which heads each of N devices holds: the one place the split over heads is decided.

The NumPy simulation, the layer on torch.distributed and the figures all slice weights with
these functions, so they cannot disagree about who holds what.
"""

from __future__ import annotations

__all__ = ["check_split", "rank_heads", "head_columns", "replica_groups"]


def check_split(n_heads: int, n_kv_heads: int, world_size: int) -> None:
    """Refuse a split that would give devices unequal work or cut a key/value head's readers apart."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if n_heads % world_size:
        raise ValueError(f"num_heads={n_heads} is not divisible by world_size={world_size}: "
                         "tensor parallelism over heads gives every device the same number of heads")
    if n_kv_heads % world_size and world_size % n_kv_heads:
        raise ValueError(f"num_kv_heads={n_kv_heads} and world_size={world_size}: one must divide the other, "
                         "so that each device's query heads read whole key/value heads")


def rank_heads(n_heads: int, n_kv_heads: int, world_size: int, rank: int) -> tuple[range, range]:
    r"""The query heads and the key/value heads device ``rank`` holds: the one place the split is decided.

    Device r gets query heads :math:`r h/N` to :math:`(r+1) h/N - 1` and every key/value head they
    read (query head i reads :math:`\lfloor i / (h / h_{kv}) \rfloor`).
    """
    check_split(n_heads, n_kv_heads, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    h_r, n_rep = n_heads // world_size, n_heads // n_kv_heads
    q_heads = range(rank * h_r, (rank + 1) * h_r)
    return q_heads, range(q_heads.start // n_rep, (q_heads.stop - 1) // n_rep + 1)


def head_columns(heads: range, d_k: int) -> slice:
    """The columns of W_Q (or W_K, W_V) that hold ``heads``; the same slice selects rows of W_O."""
    return slice(heads.start * d_k, heads.stop * d_k)


def replica_groups(n_heads: int, n_kv_heads: int, world_size: int) -> list[list[int]]:
    """The devices that hold the same key/value heads: one device per group when they are split.

    A replicated key/value head's weight gradient is the sum over its group: every device in it
    computes only the part that its own query heads contribute.
    """
    groups: dict[range, list[int]] = {}
    for r in range(world_size):
        groups.setdefault(rank_heads(n_heads, n_kv_heads, world_size, r)[1], []).append(r)
    return list(groups.values())
