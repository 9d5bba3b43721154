"""The figure style and its save-time check: every book figure passes, a bad one is refused."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mha_lab.plots import bench as bench_plots  # noqa: E402
from mha_lab.plots import cost, heads, layout, parallel  # noqa: E402
from mha_lab.plots.style import (  # noqa: E402
    FIGURE_WIDTH_IN,
    FigureStyleError,
    legend_outside,
    log_ticks,
    new_figure,
    style_problems,
    to_svg,
)

BENCH = {"rows": [
    {"section": s, "impl": i, "dtype": "float64", "h": 8, "L": L, "B": 1, "d_model": 64,
     "seconds": L * 1e-6 * k, "peak_bytes": L * L * 8 * k, "gemm_fraction": 0.5}
    for s in ("forward", "memory") for k, i in ((1, "fused"), (2, "loop")) for L in (64, 128, 256)
]}

FIGURES = {
    "heads": lambda: heads.plot_attention_heads(np.full((2, 3, 3), 1 / 3), list("abc"), annotate=True),
    "layout": lambda: layout.plot_head_split_layout(),
    "loop vs fused": lambda: layout.plot_loop_vs_fused(
        [{"heads": h, "loop_s": 1e-3 * h, "fused_s": 1e-3} for h in (1, 2, 4)]),
    "flops": lambda: cost.plot_flops_vs_length(d_model=256, n_heads=4),
    "kv cache": lambda: cost.plot_kv_cache_vs_context(lengths=[256, 1024, 8192]),
    "peak memory": lambda: cost.plot_peak_memory([256, 512, 1024], {"a": [1e6, 4e6, 16e6], "b": [1e6, 2e6, 4e6]}),
    "time": lambda: cost.plot_time_vs_length([64, 128, 256, 512], [1e-4, 3e-4, 1e-3, 4e-3], d_model=64, n_heads=4),
    "bench time": lambda: bench_plots.time_vs_length(BENCH),
    "bench memory": lambda: bench_plots.memory_vs_length(BENCH),
    "bench bars": lambda: bench_plots.implementations_bar(BENCH),
    "weight split": lambda: parallel.plot_weight_split(d_model=32, num_heads=8, num_kv_heads=1, world_size=4),
    "tp traffic": lambda: parallel.plot_tp_memory_and_traffic(),
}


@pytest.mark.parametrize("name", FIGURES)
def test_book_figures_pass_the_style_check(name):
    fig = FIGURES[name]()
    assert style_problems(fig) == []
    svg = to_svg(fig)
    assert f'width="{FIGURE_WIDTH_IN * 72:g}pt"' in svg  # one width for every figure, no tight crop


def test_small_text_is_refused_at_save_time():
    fig, ax = new_figure(3)
    ax.plot([0, 1], [0, 1])
    ax.set_title("tiny", fontsize=6)
    with pytest.raises(FigureStyleError, match="text below 10 pt.*'tiny'"):
        to_svg(fig)


def test_a_checked_figure_is_checked_again_once_changed(monkeypatch):
    from mha_lab.plots import style

    fig = cost.plot_flops_vs_length(d_model=256, n_heads=4)  # checked by the plotting function
    layouts = []
    monkeypatch.setattr(style, "style_problems", lambda f: layouts.append(f) or style_problems(f))
    to_svg(fig)
    assert layouts == []  # unchanged since it passed: saved without a second layout
    fig.axes[0].set_title("tiny", fontsize=6)  # a change after the check marks the figure stale
    with pytest.raises(FigureStyleError, match="text below 10 pt.*'tiny'"):
        to_svg(fig)
    assert layouts == [fig]


def test_a_legend_on_the_data_is_refused_and_outside_is_fine():
    fig, ax = new_figure(3)
    ax.plot([0, 1], [0, 1], label="line")
    ax.legend(loc="center")
    with pytest.raises(FigureStyleError, match="legend covers"):
        to_svg(fig)
    fig, ax = new_figure(3)
    ax.plot([0, 1], [0, 1], label="line")
    legend_outside(ax, "below")
    assert style_problems(fig) == []


def test_a_figure_of_another_width_is_refused():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3))
    with pytest.raises(FigureStyleError, match="11 in wide"):
        to_svg(fig)
    plt.close(fig)


def test_overlapping_tick_labels_are_refused_and_log_ticks_fixes_them():
    fig, ax = new_figure(3)
    ax.semilogx([200, 900], [0, 1])  # under a decade: the default labels the minor ticks, crowded
    ax.set_xticks([200, 210], ["two hundred", "two hundred and ten"])
    with pytest.raises(FigureStyleError, match="tick labels overlap on the x axis"):
        to_svg(fig)
    fig, ax = new_figure(3)
    ax.semilogx([200, 900], [0, 1])
    log_ticks(ax.xaxis)
    assert style_problems(fig) == []
    assert [t.get_text() for t in ax.xaxis.get_ticklabels() if 200 <= t.get_position()[0] <= 900] == ["200", "500"]


def test_a_log_axis_with_one_label_is_refused():
    fig, ax = new_figure(3)
    ax.semilogy([1, 2], [2.2, 3.8])  # inside one decade, with no labelled minor ticks
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    with pytest.raises(FigureStyleError, match="log y axis .* fewer than two labelled ticks"):
        to_svg(fig)


def test_log_ticks_widens_an_axis_too_short_for_two_labels():
    """Timings that land between two labelled steps (0.011 to 0.018 ms: neither 0.01 nor 0.02 inside) get
    an axis from 0.01 to 0.02, so the figure still shows its scale."""
    fig, ax = new_figure(3)
    ax.semilogy([1, 2], [0.011, 0.018])
    log_ticks(ax.yaxis)
    assert ax.get_ylim() == pytest.approx((0.01, 0.02))
    assert style_problems(fig) == []


def test_a_legend_larger_than_its_plot_is_refused():
    fig, ax = new_figure(1.6)
    for i in range(8):
        ax.plot([0, 1], [i, i], label=f"a long legend entry that names line number {i} in full")
    legend_outside(ax, "right")
    with pytest.raises(FigureStyleError, match="legend is larger than the plot"):
        to_svg(fig)
