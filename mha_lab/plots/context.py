"""Figures of context parallelism: who computes which block of a causal score matrix, and when."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from mha_lab.parallel.sequence import ring_source, zigzag_chunks
from mha_lab.plots.style import check, legend_outside, new_figure

__all__ = ["causal_pairs_per_rank", "plot_zigzag_schedule", "plot_cp_step"]


def causal_pairs_per_rank(world_size: int, zigzag: bool = True) -> np.ndarray:
    """The causal scores each rank's queries need, in chunk blocks: a chunk of c queries against an earlier
    chunk is one block (c^2 scores), against itself half of one. Each rank holds two of the 2N chunks:
    2r and 2r+1 contiguous, r and 2N-1-r zigzag. Shapes: -> (world_size,)."""
    held = [zigzag_chunks(world_size, r) if zigzag else (2 * r, 2 * r + 1) for r in range(world_size)]
    return np.array([sum(i + 0.5 for i in chunks) for chunks in held])


def plot_zigzag_schedule(world_size: int = 4) -> Figure:
    """Left: the causal score matrix cut into 2N x 2N chunk blocks, each coloured by the rank that computes it
    on the zigzag split and labelled with the ring step at which it does. Right: the pairs each rank computes,
    contiguous split against zigzag."""
    n = world_size
    owner = np.full((2 * n, 2 * n), -1)  # (query chunk, key chunk) -> rank, -1 where the mask hides it
    step = np.full((2 * n, 2 * n), -1)
    chunk_rank = {c: r for r in range(n) for c in zigzag_chunks(n, r)}
    for qc in range(2 * n):
        for kc in range(qc + 1):
            r = chunk_rank[qc]
            owner[qc, kc] = r
            step[qc, kc] = next(s for s in range(n) if ring_source(n, r, s) == chunk_rank[kc])
    fig, (left, right) = new_figure(3.6, 1, 2, width_ratios=[1, 1.2])
    colors = ListedColormap(["white", *[f"C{r}" for r in range(n)]])
    left.imshow(owner + 1, cmap=colors, vmin=0, vmax=n, origin="upper")
    for qc, kc in zip(*np.nonzero(owner >= 0), strict=True):
        left.text(kc, qc, str(step[qc, kc]), ha="center", va="center", fontsize=10, color="white")
    left.set(xlabel="key chunk", ylabel="query chunk", title="zigzag: rank (colour), step (number)")
    left.set_xticks(range(2 * n))
    left.set_yticks(range(2 * n))
    x = np.arange(n)
    for i, (zig, label) in enumerate(((False, "contiguous"), (True, "zigzag"))):
        right.bar(x + (i - 0.5) * 0.38, causal_pairs_per_rank(n, zigzag=zig), width=0.36, color=f"C{7 + i}",
                  label=label)
    right.set(xlabel="rank", ylabel="chunk blocks of scores", title="causal work per rank")
    right.set_xticks(x, [str(r) for r in x])
    right.grid(True, axis="y", alpha=0.3)
    legend_outside(right, "below", ncol=2)
    return check(fig)


def plot_cp_step(rows: Sequence[dict]) -> Figure:
    """One causal attention call, forward and backward, per rank count: time (left) and the share of it spent
    communicating (right), ring against Ulysses. ``rows``: ``measure_context_scaling``'s."""
    fig, (left, right) = new_figure(3.2, 1, 2)
    modes = sorted({r["mode"] for r in rows})
    counts = sorted({r["world_size"] for r in rows})
    x = np.arange(len(counts))
    for i, mode in enumerate(modes):
        mine = {r["world_size"]: r for r in rows if r["mode"] == mode}
        offset = (i - (len(modes) - 1) / 2) * 0.38
        left.bar(x + offset, [mine[n]["seconds"] * 1e3 for n in counts], width=0.36, color=f"C{i}", label=mode)
        right.bar(x + offset, [100 * mine[n]["comm_share"] for n in counts], width=0.36, color=f"C{i}")
    left.set(xlabel="ranks N", ylabel="ms per call (slowest rank)", title="time, forward + backward")
    right.set(xlabel="ranks N", ylabel="% of the time", title="communication not hidden")
    for ax in (left, right):
        ax.set_xticks(x, [str(n) for n in counts])
        ax.grid(True, axis="y", alpha=0.3)
    legend_outside(left, "below", ncol=2)
    return check(fig)
