"""Figures of the chapter on decoding: a paged cache's waste, the keys each eviction rule keeps,
RoPE's frequencies and scores under each way of stretching the context."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from mha_lab.cpu.rope_scaling import mean_rotary_score
from mha_lab.plots.style import check, legend_outside, new_figure

__all__ = ["plot_paged_waste", "plot_kept_keys", "plot_rope_scaling"]


def plot_paged_waste(block_sizes: Sequence[int], paged_waste: Sequence[float], contiguous_waste: float) -> Figure:
    """Share of the held cache slots that store nothing, against the block size, with the contiguous cache's."""
    fig, ax = new_figure(3.0)
    ax.semilogx(block_sizes, 100 * np.asarray(paged_waste), "o-", base=2, label="paged (measured)")
    ax.axhline(100 * contiguous_waste, color="black", linestyle="--", label="contiguous, max_len reserved")
    ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
    ax.minorticks_off()
    ax.set(xlabel="block size (positions per page)", ylabel="slots held but empty (%)", ylim=(0, 100),
           title="Cache memory wasted, one batch of mixed lengths")
    ax.grid(True, alpha=0.3)
    legend_outside(ax, "below", ncols=2)
    return check(fig)


def plot_kept_keys(masks: Mapping[str, np.ndarray]) -> Figure:
    """Which keys (columns) each query (row) may see under each rule; masks are additive (L, L)."""
    fig, axes = new_figure(2.8, 1, len(masks))
    for ax, (name, mask) in zip(np.atleast_1d(axes), masks.items(), strict=True):
        ax.imshow(mask == 0, cmap="Greys", vmin=0, vmax=1.4, interpolation="nearest")
        ax.set(title=name, xlabel="key position", ylabel="query position")
    return check(fig)


def plot_rope_scaling(freqs: Mapping[str, np.ndarray], train_len: int, max_distance: int) -> Figure:
    """Left: each pair's wavelength 2π/ω_i (positions) per method, with the training length.
    Right: the mean score of q = k = (1, ..., 1) against the distance, out to ``max_distance``."""
    fig, (left, right) = new_figure(3.4, 1, 2)
    distances = np.linspace(0, max_distance, 2000)
    for name, f in freqs.items():
        left.semilogy(np.arange(len(f)), 2 * np.pi / f, label=name)
        right.plot(distances, mean_rotary_score(f, distances))
    left.axhline(train_len, color="black", linestyle=":", label="training length")
    right.axvline(train_len, color="black", linestyle=":")
    left.set(xlabel="pair i", ylabel="wavelength 2π/ω_i (positions)", title="Frequencies")
    right.set(xlabel="distance n − m (positions)", ylabel="mean cos(ω_i (n − m))", title="Scores of q = k = 1")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    legend_outside(left, "below", ncols=3)
    return check(fig)
