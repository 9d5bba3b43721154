"""Chapter 9's GPU figure and table, drawn from the committed measurement (book/data/gpu_bench.json)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

pytest.importorskip("torch")

from mha_lab.cuda.bench_gpu import read_report  # noqa: E402
from mha_lab.plots.gpu_bench import plot_gpu_tflops, ratio_table  # noqa: E402

REPORT = read_report(Path(__file__).resolve().parents[1] / "book" / "data" / "gpu_bench.json")


def test_figure_has_a_panel_per_pass_and_both_kernels_per_shape():
    fig = plot_gpu_tflops(REPORT)
    forward, train = fig.axes[:2]
    assert [forward.get_title(), train.get_title()] == ["forward", "forward + backward"]
    for ax, pass_ in ((forward, "forward"), (train, "forward+backward")):
        assert len(ax.lines) == 8  # ours and SDPA for D in (64, 128), causal and not
        ours = next(line for line in ax.lines if line.get_label() == "ours, D = 128, full")
        rows = sorted((r for r in REPORT["rows"] if (r["dtype"], r["pass"], r["head_dim"], r["causal"])
                       == ("bfloat16", pass_, 128, False)), key=lambda r: r["seq_len"])
        assert list(ours.get_ydata()) == [r["ours_tflops"] for r in rows]
    assert "TFLOP/s" in forward.get_ylabel() and "tokens" in forward.get_xlabel()


def test_table_puts_both_passes_of_a_shape_on_one_row():
    lines = ratio_table(REPORT).splitlines()
    shapes = {(r["head_dim"], r["causal"], r["seq_len"]) for r in REPORT["rows"] if r["dtype"] == "bfloat16"}
    assert len(lines) == 2 + len(shapes)
    row = next(r for r in REPORT["rows"] if (r["dtype"], r["head_dim"], r["causal"], r["seq_len"], r["pass"])
               == ("bfloat16", 64, True, 4096, "forward+backward"))
    cells = [c.strip() for c in next(x for x in lines if x.startswith("| 64 | yes | 4,096 |")).split("|")[1:-1]]
    assert cells[6:] == [f"{row['ours_tflops']:.0f}", f"{row['sdpa_tflops']:.0f}", f"{row['ratio']:.2f}"]
