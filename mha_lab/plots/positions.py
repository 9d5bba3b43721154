"""Figures of the chapter on positions: RoPE's scores against the offset, and decoding errors per token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from mha_lab.cpu.positions import apply_rope
from mha_lab.plots.style import check, legend_outside, new_figure

__all__ = ["rope_scores", "plot_rope_scores", "plot_decode_errors"]


def rope_scores(q: np.ndarray, k: np.ndarray, query_position: int, distances: np.ndarray,
                layout: str = "half") -> np.ndarray:
    r"""Scores :math:`(R_m q) \cdot (R_{m+\Delta} k)` for the query at m and keys Δ = ``distances`` later.

    Shapes: q, k (d,), distances (n,) -> (n,).
    """
    q_rot = apply_rope(q[None], np.array([query_position]), layout)  # (1, d)
    k_rot = apply_rope(np.broadcast_to(k, (len(distances), k.shape[-1])), query_position + distances, layout)
    return k_rot @ q_rot[0]  # (n, d) @ (d,) -> (n,)


def plot_rope_scores(dim: int = 64, max_distance: int = 200, shift: int = 1000) -> Figure:
    """RoPE's score of one query and one key against their distance, with the pair at positions (0, Δ)
    and shifted to (shift, shift + Δ): the two curves are the same. q = k = (1, ..., 1) shows the decay."""
    distances = np.arange(0, max_distance + 1)
    ones = np.ones(dim)
    fig, ax = new_figure(3.4)
    ax.plot(distances, rope_scores(ones, ones, 0, distances), "-", linewidth=3, alpha=0.5,
            label="query at position 0")
    ax.plot(distances, rope_scores(ones, ones, shift, distances), "--", color="black", linewidth=1,
            label=f"query at position {shift:,}")
    ax.axhline(0, color="gray", linewidth=0.8)
    ax.set(xlabel="distance from query to key, n − m (positions)", ylabel="score q·k (unscaled)",
           title=f"RoPE, d_k = {dim}, q = k = (1, …, 1)")
    legend_outside(ax, "below", ncols=2)
    return check(fig)


def plot_decode_errors(errors: Mapping[str, Sequence[float]], positions: Sequence[int], floor: float = 1e-17) -> Figure:
    """Largest difference from the full causal forward at each decoded position, one line per decoder, log y.

    Differences below ``floor`` (exact zeros included) are drawn at ``floor``.
    """
    fig, ax = new_figure(3.4)
    for (name, err), marker in zip(errors.items(), "os^v", strict=False):
        ax.semilogy(positions, np.maximum(np.asarray(err), floor), marker + "-", label=name)
    ax.set(xlabel="position of the decoded token", ylabel="largest |difference|",
           title="Token-by-token decoding against the full forward")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(ax, "below", ncols=3)
    return check(fig)
