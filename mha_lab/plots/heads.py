"""Attention-pattern figures: one heat map per head, and the toy model's training curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from mha_lab.plots.style import FIGURE_WIDTH_IN, check, legend_outside, log_ticks, new_figure
from mha_lab.toy import ToyBatch, ToyModel, ToyRun

__all__ = ["plot_attention_heads", "plot_toy_heads", "plot_toy_training"]


def plot_attention_heads(weights: np.ndarray, labels: Sequence[str] | None = None,
                         titles: Sequence[str] | None = None, annotate: bool = False) -> Figure:
    """Heat maps of h attention matrices side by side; rows are queries, columns are keys.

    Shapes: weights: (h, L_q, L_k), each row a distribution (sums to 1). ``labels`` name the L
    positions; ``annotate`` prints each weight in its cell (for small L).
    """
    weights = np.asarray(weights)
    if weights.ndim != 3:
        raise ValueError(f"weights must have shape (h, L_q, L_k), got {weights.shape}")
    h, L_q, L_k = weights.shape
    if titles is not None and len(titles) != h:
        raise ValueError(f"got {len(titles)} titles for {h} heads")
    panel = (FIGURE_WIDTH_IN - 1.4) / h  # inches per heat map, the colour bar takes the rest
    height = 1.6 + panel * L_q / L_k + (0.4 if labels is not None else 0.0)
    fig, axes = new_figure(height, 1, h, squeeze=False)
    for i, ax in enumerate(axes[0]):
        im = ax.imshow(weights[i], vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(titles[i] if titles else f"head {i}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        if labels is not None:
            ax.set_xticks(range(L_k), labels[:L_k], rotation=90)
            ax.set_yticks(range(L_q), labels[-L_q:])
        if annotate:
            for (r, c), w in np.ndenumerate(weights[i]):
                ax.text(c, r, f"{w:.2f}", ha="center", va="center", color="w" if w < 0.6 else "k", fontsize=10)
    fig.colorbar(im, ax=axes[0].tolist(), label="attention weight", shrink=0.8)
    return check(fig)


def plot_toy_heads(model: ToyModel, batch: ToyBatch, index: int = 0) -> Figure:
    """Each head's attention on one sequence of the toy task, from the second-half queries.

    Tick labels read ``letter digit`` (letters A, B, ...). A ring marks the previous position and
    a cross the matching position of every query, so each head's relation can be read off.
    """
    model.forward(batch)
    n = model.task.half
    A = model.mha.attention_weights[index, :, n:]  # (B, h, L, L) -> (h, half, L)
    labels = [f"{chr(65 + a)}{d}" for a, d in zip(batch.letters[index], batch.digits[index], strict=True)]
    fig = plot_attention_heads(A, labels, titles=[f"head {i}" for i in range(model.num_heads)])
    rows = np.arange(n)
    for ax in fig.axes[:model.num_heads]:
        ax.scatter(rows + n - 1, rows, s=120, facecolors="none", edgecolors="tab:red", label="previous position")
        ax.scatter(batch.match_pos[index], rows, s=60, marker="x", color="tab:orange", label="matching letter")
    handles, names = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=2)
    return check(fig)


def plot_toy_training(runs: Mapping[str, ToyRun], window: int = 25) -> Figure:
    """Training loss against step for several toy runs (e.g. 1 head vs 2 heads), log scale: the
    running mean over ``window`` steps, with each step's loss faint behind it."""
    fig, ax = new_figure(3.8)
    for name, run in runs.items():
        losses = np.asarray(run.losses)
        steps = np.arange(1, losses.size + 1)
        w = min(window, losses.size)
        mean = np.convolve(losses, np.ones(w) / w, mode="valid")  # (n - w + 1,): mean of steps i..i+w-1
        (line,) = ax.plot(steps[w - 1:], mean, label=f"{name}: both digits right "
                          f"{100 * run.accuracy['both']:.0f}%")
        ax.plot(steps, losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_yscale("log")
    log_ticks(ax.yaxis)
    ax.set_xlabel(f"training step (one batch each); line: mean of the last {window} steps")
    ax.set_ylabel("loss (nats, two cross-entropies)")
    legend_outside(ax, "below", ncol=len(runs))
    return check(fig)
