"""Benchmark figures: time and peak memory against L, and implementations side by side.

Each function takes the ``BenchResults`` of ``mha_lab.bench.run_suite`` (or its JSON dict)
and returns a Figure with log axes and units on both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from mha_lab.bench import TARGET_H, BenchResults
from mha_lab.plots.style import check, legend_outside, log_ticks, new_figure

__all__ = ["time_vs_length", "memory_vs_length", "implementations_bar", "save_figures"]


def _rows(results: BenchResults | dict) -> list[dict]:
    return results.rows if isinstance(results, BenchResults) else results["rows"]


def _lines(results, section: str, key: str, scale: float, h: int, ylabel: str, title: str) -> Figure:
    """One line per (implementation, dtype): ``key`` against L at ``h`` heads, log-log."""
    rows = [r for r in _rows(results) if r["section"] == section and r["h"] == h and r[key]]
    if not rows:
        raise ValueError(f"no {section} measurements at h={h} in these results")
    fig, ax = new_figure(4.2)
    for impl, dtype in dict.fromkeys((r["impl"], r["dtype"]) for r in rows):
        pts = sorted((r["L"], r[key] * scale) for r in rows if (r["impl"], r["dtype"]) == (impl, dtype))
        Ls, ys = zip(*pts, strict=True)
        ax.loglog(Ls, ys, "o-", label=f"{impl} ({dtype})")
    B, d = rows[0]["B"], rows[0]["d_model"]
    ax.set(xlabel="sequence length L (tokens)", ylabel=ylabel, title=f"{title}\nB = {B}, d_model = {d}, h = {h}")
    Ls = sorted({r["L"] for r in rows})
    ax.set_xticks(Ls, [str(L) for L in Ls])
    ax.xaxis.set_minor_formatter(NullFormatter())  # label only the measured lengths
    log_ticks(ax.yaxis)  # a quick run's times may span less than a decade: no crowded minor labels
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(ax, "below", ncol=2)  # long names: beside the plot the legend would be as large as the plot
    return check(fig)


def _statistic(results: BenchResults | dict) -> str:
    """How the run reduced its repeats to one time, in words: "median" or "fastest"."""
    config = results.config if isinstance(results, BenchResults) else results.get("config", {})
    return "fastest" if config.get("statistic") == "min" else "median"


def time_vs_length(results: BenchResults | dict, h: int = TARGET_H) -> Figure:
    """Forward time (ms; median or fastest of the repeats) of every implementation against L, log-log."""
    return _lines(results, "forward", "seconds", 1e3, h, f"{_statistic(results)} forward time (ms)",
                  "Forward time")


def memory_vs_length(results: BenchResults | dict, h: int = TARGET_H) -> Figure:
    """Peak memory of the forward (MiB) of every implementation against L, log-log."""
    return _lines(results, "memory", "peak_bytes", 1 / 2**20, h, "peak memory of the forward (MiB)",
                  "Peak memory (NumPy: tracemalloc; torch: torch.profiler)")


def implementations_bar(results: BenchResults | dict, L: int | None = None, h: int = TARGET_H) -> Figure:
    """Horizontal bars: forward time (ms) of each implementation at one L (default the largest), log axis,
    annotated with the achieved fraction of the BLAS GEMM rate."""
    rows = [r for r in _rows(results) if r["section"] == "forward" and r["h"] == h and r["seconds"]]
    if not rows:
        raise ValueError(f"no forward measurements at h={h} in these results")
    L = L or max(r["L"] for r in rows)
    rows = sorted((r for r in rows if r["L"] == L), key=lambda r: r["seconds"])
    if not rows:
        raise ValueError(f"no forward measurements at L={L}, h={h}")
    ms = np.array([r["seconds"] * 1e3 for r in rows])
    fig, ax = new_figure(0.5 * len(rows) + 1.4)
    ax.barh([f"{r['impl']} ({r['dtype']})" for r in rows], ms, color="tab:blue")
    for y, (r, t) in enumerate(zip(rows, ms, strict=True)):
        share = f"  {r['gemm_fraction']:.0%} of GEMM" if r.get("gemm_fraction") else ""
        ax.text(t, y, f" {t:.0f} ms{share}", va="center")
    ax.set_xscale("log")
    ax.set_xlim(ms.min() / 2, ms.max() * 8)
    log_ticks(ax.xaxis)
    ax.invert_yaxis()
    ax.set(xlabel=f"{_statistic(results)} forward time (ms, log scale)",
           title=f"B = {rows[0]['B']}, L = {L}, d_model = {rows[0]['d_model']}, h = {h}")
    ax.grid(True, axis="x", which="major", alpha=0.3)
    return check(fig)


def save_figures(results: BenchResults | dict, out: Path) -> list[Path]:
    """Write the figures above whose section was measured (``--sections``) as PNGs (2x) into the folder ``out``;
    returns their paths."""
    measured = {r["section"] for r in _rows(results)}
    paths = []
    for make, section in ((time_vs_length, "forward"), (memory_vs_length, "memory"), (implementations_bar, "forward")):
        if section in measured:
            paths.append(Path(out) / f"{make.__name__}.png")
            make(results).savefig(paths[-1], dpi=192)
    return paths
