"""The GPU benchmark as the book shows it: TFLOP/s against sequence length, and the table of ratios.

Both read a report of ``python -m mha_lab bench --gpu`` (``mha_lab.cuda.bench_gpu.read_report``),
so a chapter draws a measurement made once on a GPU at every build, on any machine.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from mha_lab.plots.style import check, legend_outside, new_figure
from mha_lab.tables import markdown_table

__all__ = ["plot_gpu_tflops", "ratio_table"]

_SHAPES = {(64, False): "tab:blue", (64, True): "tab:cyan", (128, False): "tab:red", (128, True): "tab:orange"}


def _label(head_dim: int, causal: bool) -> str:
    return f"D = {head_dim}, {'causal' if causal else 'full'}"


def plot_gpu_tflops(report: dict, dtype: str = "bfloat16") -> Figure:
    """Achieved TFLOP/s against L for ``dtype``: one panel per pass (forward; forward and backward),
    our kernel solid and SDPA's flash backend dashed, one colour per (head size, causal)."""
    fig, axes = new_figure(3.4, 1, 2, sharey=True)
    for ax, pass_ in zip(axes, ("forward", "forward+backward"), strict=True):
        for (head_dim, causal), colour in _SHAPES.items():
            rows = sorted((r for r in report["rows"] if r["dtype"] == dtype and r["pass"] == pass_
                           and r["head_dim"] == head_dim and r["causal"] == causal), key=lambda r: r["seq_len"])
            if not rows:
                continue
            L = [r["seq_len"] for r in rows]
            ax.plot(L, [r["ours_tflops"] for r in rows], "o-", color=colour,
                    label=f"ours, {_label(head_dim, causal)}")
            ax.plot(L, [r["sdpa_tflops"] for r in rows], "s--", color=colour, markersize=4,
                    label=f"SDPA flash, {_label(head_dim, causal)}")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["seq_len"] for r in report["rows"]})
        ax.set_xticks(ticks, [f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in ticks])
        ax.set(title=pass_.replace("+", " + "), xlabel="sequence length L (tokens)")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel(f"achieved TFLOP/s ({dtype})")
    legend_outside(axes[0], "below", ncol=2)
    return check(fig)


def ratio_table(report: dict, dtype: str = "bfloat16") -> str:
    """A Markdown table for ``dtype``: one row per (D, causal, L), with TFLOP/s of ours and of SDPA flash and
    their ratio, forward and forward + backward side by side."""
    cells = {(r["head_dim"], r["causal"], r["seq_len"], r["pass"]): r for r in report["rows"] if r["dtype"] == dtype}
    keys = sorted({k[:3] for k in cells})
    rows = []
    for head_dim, causal, L in keys:
        row = [head_dim, "yes" if causal else "no", f"{L:,}"]
        for pass_ in ("forward", "forward+backward"):
            r = cells.get((head_dim, causal, L, pass_))
            row += [f"{r['ours_tflops']:.0f}", f"{r['sdpa_tflops']:.0f}", f"{r['ratio']:.2f}"] if r else ["", "", ""]
        rows.append(row)
    return markdown_table(["D", "causal", "L", "forward: ours", "SDPA", "ratio",
                           "fwd + bwd: ours", "SDPA", "ratio"], rows)
