"""FlashAttention's figures: one query row's running state as key tiles stream past, and memory traffic."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from mha_lab.plots.style import check, legend_outside, new_figure
from mha_lab.tables import markdown_table
from mha_lab.traffic import ALGORITHMS, hbm_traffic, simulate_traffic, tile_shape, traffic_breakdown

__all__ = ["plot_tile_state", "plot_traffic_vs_fast_memory", "traffic_table"]

_LABELS = {"standard": "standard (S, P in slow memory)", "flash1": "FlashAttention (K/V outer)",
           "flash2": "FlashAttention-2 (Q outer)"}
_SHORT = {"standard": "standard", "flash1": "FlashAttention", "flash2": "FlashAttention-2"}  # in the table


def plot_tile_state(Q: np.ndarray, K: np.ndarray, V: np.ndarray, sram: int) -> Figure:
    """Query row 0's running max (``m``), ℓ and acc / ℓ after each key tile of ``simulate_traffic``'s
    FlashAttention-2 loop.

    Shapes: Q, K, V (L, d_k). Three panels against the number of key tiles seen: the running max with
    the largest score of each tile, the normaliser ℓ, and the running output acc / ℓ (its first
    components) approaching the exact output, drawn dashed.
    """
    sim = simulate_traffic(Q, K, V, sram, "flash2")
    trace, n = sim.trace, np.arange(1, len(sim.trace.m) + 1)
    b = tile_shape(Q.shape[1], sram)[1]  # keys per tile: the inner block (the last may be shorter)
    scores = Q[0] @ K.T / np.sqrt(Q.shape[1])  # (N,)
    tile_max = [scores[i * b:(i + 1) * b].max() for i in range(len(n))]
    fig, axes = new_figure(3.0, 1, 3)
    ax = axes[0]
    ax.plot(n, tile_max, "o", color="tab:gray", label="largest score in the tile")
    ax.step(n, trace.m, where="post", color="tab:blue", label=r"running max $s_\mathrm{max}$")
    ax.set(title=r"running max $s_\mathrm{max}$", xlabel="key tiles seen", ylabel="score")
    axes[1].plot(n, trace.l, "o-", color="tab:orange")
    axes[1].set(title="normaliser ℓ", xlabel="key tiles seen", ylabel="ℓ")
    ax = axes[2]
    running = np.array(trace.acc) / np.array(trace.l)[:, None]  # (tiles, d)
    for c in range(min(3, running.shape[1])):
        line, = ax.plot(n, running[:, c], "o-", label=f"component {c}")
        ax.axhline(sim.out[0, c], color=line.get_color(), linestyle="--", linewidth=1)
    ax.set(title="output acc / ℓ", xlabel="key tiles seen", ylabel="value")
    for ax in axes:
        ax.set_xticks(n)
    handles = [h for a in (axes[0], axes[2]) for h in a.get_legend_handles_labels()[0]]
    names = [t for a in (axes[0], axes[2]) for t in a.get_legend_handles_labels()[1]]
    fig.legend(handles, names, loc="outside lower center", ncol=3)
    return check(fig)


def plot_traffic_vs_fast_memory(L: int, d_k: int, srams: Sequence[int], dtype: str = "float16") -> Figure:
    """Bytes moved between slow and fast memory by one head's forward against the fast-memory size (elements),
    for each algorithm of ``mha_lab.traffic`` with the paper's tiles (solid) and FlashAttention-2 with square
    tiles (dashed), on log-log axes, with the slope -1 of Θ(L² d_k² / sram)."""
    fig, ax = new_figure(3.6)
    srams = np.asarray(srams)
    kib = srams * 2 / 2**10 if dtype == "float16" else srams
    for algorithm in ALGORITHMS:
        ax.plot(kib, [hbm_traffic(L, d_k, int(M), algorithm, dtype) / 2**20 for M in srams], "o-",
                label=_LABELS[algorithm])
    ax.plot(kib, [hbm_traffic(L, d_k, int(M), "flash2", dtype, "square") / 2**20 for M in srams], "s--",
            color=ax.lines[-1].get_color(), label=f"{_LABELS['flash2']}, square tiles")
    ref = hbm_traffic(L, d_k, int(srams[0]), "flash2", dtype) / 2**20 * srams[0] / srams
    ax.plot(kib, ref, ":", color="gray", label=r"$\propto 1/M_\mathrm{SRAM}$")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("fast memory (KiB of fp16)" if dtype == "float16" else "fast memory (elements)")
    ax.set_ylabel("slow-memory traffic (MiB)")
    legend_outside(ax, "right")
    return check(fig)


def traffic_table(L: int, d_k: int, srams: Sequence[int], seed: int = 0,
                  cases: Sequence[tuple[str, str]] | None = None) -> str:
    """Slow-memory traffic of one head's forward (elements) for each (algorithm, tiling) and fast-memory size:
    the closed form of ``traffic_breakdown`` and how far the count of ``simulate_traffic`` on random Q, K, V
    (L, d_k) is from it, the blocks (outer x inner rows) and the largest working set the simulation held. By
    default every algorithm with the paper's tiles, then FlashAttention-2 with square ones."""
    Q, K, V = np.random.default_rng(seed).standard_normal((3, L, d_k))
    cases = cases or [*((a, "paper") for a in ALGORITHMS), ("flash2", "square")]
    rows = []
    for M in srams:
        for algorithm, tiling in cases:
            formula = traffic_breakdown(L, d_k, M, algorithm, tiling)
            sim = simulate_traffic(Q, K, V, M, algorithm, tiling)
            total = sum(formula["reads"].values()) + sum(formula["writes"].values())
            counted = sum(sim.reads.values()) + sum(sim.writes.values())
            sp = sum(c.get(a, 0) for c in (formula["reads"], formula["writes"]) for a in "SP")
            outer, inner = tile_shape(d_k, M, tiling)
            name = _SHORT[algorithm] + (" (square)" if tiling == "square" else "")
            rows.append((f"{M:,}", f"{outer} x {inner}", name,
                         f"{total:,}", f"{counted - total:,}", f"{sp / total:.0%}", f"{sim.peak:,}",
                         f"{hbm_traffic(L, d_k, M, algorithm, tiling=tiling) / 2**20:.1f}"))
    return markdown_table(["M_SRAM", "tiles", "algorithm", "formula", "simulated − formula", "S and P",
                           "working set", "MiB"], rows)
