"""Chapter 1's first figures: attention as a soft lookup, masking and renormalisation, heads split and merged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mha_lab.cpu.functional import softmax
from mha_lab.plots.style import check, new_figure

__all__ = ["plot_lookup", "plot_masking", "plot_split_merge"]

_HEAD_COLOURS = ("tab:orange", "tab:purple", "tab:green", "tab:red")


def _check_row(tokens: Sequence[str], row: np.ndarray, name: str) -> np.ndarray:
    row = np.asarray(row, dtype=float)
    if row.shape != (len(tokens),):
        raise ValueError(f"{name} must have one entry per token ({len(tokens)}), got shape {row.shape}")
    return row


def _bars(ax, tokens: Sequence[str], heights: np.ndarray, title: str, ylabel: str = "weight",
          hidden: np.ndarray | None = None) -> None:
    """One bar per key token; ``hidden`` keys are drawn as grey hatched outlines labelled -inf."""
    x = np.arange(len(tokens))
    hidden = np.zeros(len(tokens), bool) if hidden is None else hidden
    ax.bar(x[~hidden], heights[~hidden], color="tab:blue")
    for i in np.flatnonzero(hidden):
        ax.bar(i, 1.0, color="none", edgecolor="tab:gray", hatch="//")
        ax.text(i, 0.5, "−∞", ha="center", va="center", color="tab:gray",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    for i in np.flatnonzero(~hidden):
        ax.text(i, heights[i] + 0.02, f"{heights[i]:.2f}", ha="center", va="bottom", fontsize=10, rotation=90)
    ax.set_xticks(x, tokens, rotation=90)
    ax.set_ylim(0, 1.25)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("key")


def plot_lookup(tokens: Sequence[str], scores: np.ndarray, query: str) -> Figure:
    """A query's hard lookup (all weight on the best-matching key) beside its soft lookup, softmax(scores).

    Shapes: scores (L,), one per key token.
    """
    scores = _check_row(tokens, scores, "scores")
    hard = (np.arange(len(tokens)) == np.argmax(scores)).astype(float)
    fig, axes = new_figure(3.2, 1, 2, sharey=True)
    _bars(axes[0], tokens, hard, f"hard lookup: '{query}'")
    _bars(axes[1], tokens, softmax(scores), f"soft lookup: '{query}'")
    axes[1].set_ylabel("")
    return check(fig)


def plot_masking(tokens: Sequence[str], scores: np.ndarray, allowed: np.ndarray, query: str) -> Figure:
    """Masking as renormalisation: softmax over every key; the allowed keys' share of it, summing to less
    than one; and that share divided by its sum, which is the softmax of the masked scores.

    Shapes: scores (L,); allowed (L,) booleans, True where the query may attend.
    """
    scores = _check_row(tokens, scores, "scores")
    allowed = _check_row(tokens, allowed, "allowed").astype(bool)
    full = softmax(scores)
    kept = np.where(allowed, full, 0.0)
    fig, axes = new_figure(3.4, 1, 3, sharey=True)
    _bars(axes[0], tokens, full, "every key")
    _bars(axes[1], tokens, kept, f"future hidden: sum {kept.sum():.2f}", hidden=~allowed)
    _bars(axes[2], tokens, kept / kept.sum(), "renormalised: sum 1", hidden=~allowed)
    for ax in axes[1:]:
        ax.set_ylabel("")
    fig.suptitle(f"query '{query}'")
    return check(fig)


def _matrix(ax, values: np.ndarray, title: str, rows: Sequence[str], cols: Sequence[str] | None,
            xlabel: str, cmap: str = "viridis", vmin: float | None = None, vmax: float | None = None):
    im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_title(title)
    ax.set_yticks(range(len(rows)), rows)
    if cols is None:
        ax.set_xticks(range(values.shape[1]))
    else:
        ax.set_xticks(range(len(cols)), cols, rotation=90)
    ax.set_xlabel(xlabel)
    return im


def _outline_heads(ax, num_heads: int, d_k: int, L: int) -> None:
    """Coloured boxes around each head's d_k columns, drawn just inside the axes so no spine hides them."""
    for side in ax.spines.values():
        side.set_visible(False)
    for i in range(num_heads):
        ax.add_patch(Rectangle((i * d_k - 0.42, -0.42), d_k - 0.16, L - 0.16, fill=False, linewidth=3,
                               edgecolor=_HEAD_COLOURS[i % len(_HEAD_COLOURS)], clip_on=False))


def plot_split_merge(tokens: Sequence[str], X: np.ndarray, weights: np.ndarray, concat: np.ndarray) -> Figure:
    """Several heads: X's features split into h slices (boxed by colour), each head's attention weights,
    and the heads' outputs merged back side by side, each in its own slice.

    Shapes: X (L, d_model); weights (h, L, L); concat (L, d_model), head i in columns i d_k to (i+1) d_k - 1.
    """
    X, weights, concat = np.asarray(X), np.asarray(weights), np.asarray(concat)
    h, L = weights.shape[0], len(tokens)
    if X.shape[0] != L or concat.shape != X.shape or weights.shape != (h, L, L) or X.shape[1] % h:
        raise ValueError(f"expected X and concat (L, d_model) with d_model divisible by h, weights (h, L, L) "
                         f"for L={L}; got {X.shape}, {concat.shape}, {weights.shape}")
    d_k = X.shape[1] // h
    fig, axes = new_figure(4.2, 1, h + 2, width_ratios=[1.0] + [1.3] * h + [1.0])
    lim = float(np.abs(np.concatenate([X, concat])).max())
    _matrix(axes[0], X, f"X, split in {h}", tokens, None, "feature", cmap="RdBu", vmin=-lim, vmax=lim)
    _outline_heads(axes[0], h, d_k, L)
    for i in range(h):
        ax = axes[1 + i]
        im = _matrix(ax, weights[i], f"head {i}", tokens, tokens, "key", vmin=0.0, vmax=1.0)
        for side in ax.spines.values():
            side.set(edgecolor=_HEAD_COLOURS[i % len(_HEAD_COLOURS)], linewidth=3)
        ax.set_yticklabels([])
    _matrix(axes[-1], concat, "heads merged", tokens, None, "feature", cmap="RdBu", vmin=-lim, vmax=lim)
    _outline_heads(axes[-1], h, d_k, L)
    axes[-1].set_yticklabels([])
    fig.colorbar(im, ax=axes[1:1 + h].tolist(), label="attention weight", location="bottom", shrink=0.6)
    return check(fig)
