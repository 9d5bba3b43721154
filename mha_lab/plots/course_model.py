"""Figures of the course's trained model (``python -m mha_lab lm-eval``'s measurements): where each head's
attention goes, and perplexity past the training length."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from mha_lab.plots.style import check, legend_outside, log_ticks, new_figure

__all__ = ["plot_attention_to_first", "plot_long_context"]


def plot_attention_to_first(shares: Mapping[str, np.ndarray], what: Mapping[str, str]) -> Figure:
    """One heat map per model: the share of attention (%) each head (column) of each layer (row) gives.

    ``shares``: name -> (layers, heads) in [0, 1]; ``what``: name -> the panel's title.
    """
    fig, axes = new_figure(2.9, 1, len(shares))
    for ax, (name, share) in zip(np.atleast_1d(axes), shares.items(), strict=True):
        ax.imshow(100 * share, cmap="Blues", vmin=0, vmax=100)
        for (layer, head), s in np.ndenumerate(share):
            ax.text(head, layer, f"{100 * s:.0f}", ha="center", va="center", fontsize=10,
                    color="white" if s > 0.55 else "black")
        ax.set(title=what[name], xlabel="head", ylabel="layer",
               xticks=range(share.shape[1]), yticks=range(share.shape[0]))
    return check(fig)


def plot_long_context(tables: Mapping[str, Mapping[str, Mapping[str, float]]], train_len: int,
                      names: Mapping[str, str], lengths: Sequence[int]) -> Figure:
    """Perplexity against the context length (bytes), one panel per table (before and after the fine-tune),
    one line per RoPE scaling; the dotted line is the training length."""
    fig, axes = new_figure(3.3, 1, len(tables))
    values = [row[str(n)] for table in tables.values() for row in table.values() for n in lengths]
    wide = max(values) / min(values) > 3  # a log scale only where it shows more than a few labels
    for ax, (title, table) in zip(np.atleast_1d(axes), tables.items(), strict=True):
        for method, row in table.items():
            ax.plot(lengths, [row[str(n)] for n in lengths], "o-", label=names[method])
        ax.axvline(train_len, color="black", linestyle=":", label="training length")
        ax.set_xscale("log", base=2)
        ax.set(title=title, xlabel="context length (bytes)")
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        if wide:
            ax.set_yscale("log")
            log_ticks(ax.yaxis)
    for ax in np.atleast_1d(axes):
        ax.set_ylabel("perplexity per byte")
    legend_outside(np.atleast_1d(axes)[0], "below", ncols=3)
    return check(fig)
