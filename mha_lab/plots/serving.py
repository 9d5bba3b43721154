"""Figures of the chapter on serving: cascade attention's bytes against the number of requests, one mixed
step's FLOPs and bytes, and speculative decoding's acceptance and speed-up against the number of drafts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from mha_lab.plots.style import check, legend_outside, log_ticks, new_figure

__all__ = ["plot_cascade_bytes", "plot_step_cost", "plot_speculative"]


def plot_cascade_bytes(requests: Sequence[int], plain: Sequence[float], cascade: Sequence[float]) -> Figure:
    """Bytes one decoding step reads (MB, log-log) against the number of requests sharing the prefix."""
    fig, ax = new_figure(3.0)
    ax.loglog(requests, np.asarray(plain) / 1e6, "o-", label="plain: the prefix read by every request")
    ax.loglog(requests, np.asarray(cascade) / 1e6, "s-", label="cascade: the prefix read once")
    ax.set(xlabel="requests sharing the prefix, B", ylabel="bytes read per step (MB)",
           title="One decoding step over a shared prefix")
    log_ticks(ax.xaxis)
    log_ticks(ax.yaxis)
    ax.grid(True, alpha=0.3)
    legend_outside(ax, "below", ncols=1)
    return check(fig)


def plot_step_cost(flops: Mapping[str, float], n_bytes: Mapping[str, float]) -> Figure:
    """One engine step's FLOPs (left, GFLOP) and bytes (right, GB), each a bar per part of the work."""
    fig, (left, right) = new_figure(3.0, 1, 2)
    for ax, parts, unit in ((left, flops, "GFLOP (log scale)"), (right, n_bytes, "GB (log scale)")):
        names = list(parts)
        values = np.array([parts[n] for n in names]) / 1e9
        bars = ax.barh(names, values, color="tab:blue")
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 10 else f"{v:.2g}" for v in values], padding=3)
        ax.set_xscale("log")
        ax.set_xlim(values.min() / 3, values.max() * 30)  # room for the labels
        log_ticks(ax.xaxis)
        ax.invert_yaxis()
        ax.set(xlabel=unit)
        ax.grid(True, axis="x", alpha=0.3)
    left.set_title("FLOPs")
    right.set_title("Bytes moved")
    return check(fig)


def plot_speculative(ks: Sequence[int], acceptance: Sequence[float], per_round: Sequence[float],
                     predicted: Sequence[float], speedups: Mapping[str, Sequence[float]]) -> Figure:
    """Left: measured acceptance rate and tokens per target pass against k, with the formula's tokens.
    Right: expected speed-up against k for each draft cost."""
    fig, (left, right) = new_figure(3.4, 1, 2)
    left.plot(ks, per_round, "o", label="tokens per target pass (measured)")
    left.plot(ks, predicted, "-", color="black", label=r"$(1 - \rho^{k+1}) / (1 - \rho)$ at each ρ")
    left.plot(ks, acceptance, "s--", label="acceptance rate ρ (measured)")
    left.set(xlabel="drafts per round, k", ylabel="tokens, or rate", title="Measured on the model")
    for name, values in speedups.items():
        right.plot(ks, values, "o-", label=name)
    right.axhline(1.0, color="black", linestyle=":")
    right.set(xlabel="drafts per round, k", ylabel="speed-up over plain decoding", title="Expected speed-up")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.set_xticks(list(ks))
    legend_outside(left, "below", ncols=1)
    legend_outside(right, "right", title="draft cost")
    return check(fig)
