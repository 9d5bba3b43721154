"""Memory-layout figures: where the head split's elements live, and the per-head loop vs the fused layer."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from mha_lab.cpu import MultiHeadAttention, per_head_attention, split_heads
from mha_lab.measure import fastest_runs
from mha_lab.plots.style import check, legend_outside, log_ticks, new_figure

__all__ = ["describe_layout", "plot_head_split_layout", "time_loop_vs_fused", "plot_loop_vs_fused"]


def describe_layout(x: np.ndarray) -> dict[str, object]:
    """Shape, strides in bytes (NumPy's ``.strides``) and in elements, and whether ``x`` is C-contiguous
    and owns its memory (a copy) or not (a view)."""
    return {
        "shape": x.shape,
        "strides (bytes)": x.strides,
        "strides (elements)": tuple(s // x.itemsize for s in x.strides),
        "C-contiguous": bool(x.flags["C_CONTIGUOUS"]),
        "view": x.base is not None,
    }


def plot_head_split_layout(seq_len: int = 3, num_heads: int = 2, d_k: int = 3) -> Figure:
    """Memory offsets of Q (L, h*d_k) read in the order of its head-split view (h, L, d_k).

    Top: the buffer as it lies in memory, coloured by head. Bottom: the same elements in the order
    a C-order walk of the transposed view visits them; each cell shows its offset in memory, so the
    jumps of d_model elements between tokens are visible.
    """
    d_model = num_heads * d_k
    offsets = np.arange(seq_len * d_model).reshape(1, seq_len, d_model)  # (1, L, d_model), offset = index
    view = split_heads(offsets, num_heads)[0]  # (1, L, d_model) -> (h, L, d_k), a strided view
    head_of = np.arange(d_model) // d_k  # (d_model,)
    visit = view.reshape(-1)  # C order of the view: a copy, listing offsets in visiting order
    fig, axes = new_figure(3.2, 2, 1)
    cmap = plt.get_cmap("tab10")
    rows = (("in memory: Q as (L, d_model)", np.arange(visit.size)), ("visit order of the view (h, L, d_k)", visit))
    for ax, (title, order) in zip(axes, rows, strict=True):
        for k, off in enumerate(order):
            token, feature = divmod(int(off), d_model)
            ax.add_patch(plt.Rectangle((k, 0), 1, 1, color=cmap(head_of[feature]), alpha=0.35 + 0.65 * (token % 2)))
            ax.text(k + 0.5, 0.5, str(off), ha="center", va="center", fontsize=10)
        ax.set_xlim(0, visit.size)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_title(title, fontsize=11)
    axes[1].set_xlabel("step of the walk; each cell shows its offset in memory (elements)")
    axes[0].set_xlabel("offset in memory (elements); colour: head, shade: token")
    return check(fig)


def time_loop_vs_fused(head_counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), batch_size: int = 2,
                       seq_len: int = 64, d_model: int = 256, repeat: int = 9, seed: int = 0,
                       rounds: int = 2) -> list[dict]:
    """Fastest wall time of ``per_head_attention`` (a Python loop over heads) and of the fused
    ``MultiHeadAttention.forward`` on the same weights, for each head count.

    The two run round-robin (``mha_lab.measure.fastest_runs``), so a burst of load on a shared
    machine slows both rather than one, and each reading is the fastest of ``repeat`` runs, since other
    work on the machine only ever adds time; ``rounds`` readings are taken, to show how far they wander.
    Returns one record per h: ``{"heads", "loop_s", "fused_s", "ratio", "loop_runs", "fused_runs"}``
    (seconds, the fastest reading; ratio = loop / fused; the readings of each round).
    """
    X = np.random.default_rng(seed).standard_normal((batch_size, seq_len, d_model))  # (B, L, d_model)
    records = []
    for h in head_counts:
        layer = MultiHeadAttention(d_model, h, seed=seed)
        t = fastest_runs({"loop": lambda layer=layer: per_head_attention(X, layer),
                          "fused": lambda layer=layer: layer.forward(X)}, runs=rounds, repeat=repeat)
        loop, fused = min(t["loop"]), min(t["fused"])
        records.append({"heads": h, "loop_s": loop, "fused_s": fused, "ratio": loop / fused,
                        "loop_runs": t["loop"], "fused_runs": t["fused"]})
    return records


def plot_loop_vs_fused(records: Sequence[dict[str, float]]) -> Figure:
    """Wall time of the per-head loop and of the fused layer against the number of heads (log-log)."""
    h = [r["heads"] for r in records]
    fig, ax = new_figure(3.8)
    ax.plot(h, [1e3 * r["loop_s"] for r in records], "o-", label="loop over heads")
    ax.plot(h, [1e3 * r["fused_s"] for r in records], "s-", label="fused layer")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(h, [str(x) for x in h])
    log_ticks(ax.yaxis)
    ax.set_xlabel("number of heads h (d_model fixed)")
    ax.set_ylabel("fastest time per forward (ms)")
    legend_outside(ax)
    return check(fig)
