"""The cost figures and tables: right numbers, labelled axes, and a memory measurement that measures."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from mha_lab.analysis import MODEL_CONFIGS  # noqa: E402
from mha_lab.measure import fit_exponent  # noqa: E402
from mha_lab.plots import cost  # noqa: E402


def _labelled(fig):
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel(), "every axis carries a label"
        assert ax.lines or ax.patches or ax.images


def test_kv_cache_table_has_the_llama2_70b_figures():
    row = next(r for r in cost.kv_cache_table(4096).splitlines() if r.startswith("| Llama-2-70B"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "8" and cells[6] == "GQA"
    assert cells[8] == "320"  # KiB per token
    assert cells[9] == "1.25" and len(cells) == 10  # GiB at 4096 tokens (the chapter gives GB in its text)


def test_flops_table_ratio_is_2d_over_L():
    row = cost.flops_table([(1, 2048, 4096, 32)]).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "4"
    assert float(cells[4].replace(",", "")) * 1e9 == pytest.approx(8 * 2048 * 4096**2, rel=1e-3)  # GFLOP


def test_memory_table_attention_weights_dominate_at_long_length():
    row = cost.memory_table([(1, 8192, 512, 8)]).splitlines()[-1]
    # h L^2 / (h L^2 + 5 L d) = 8*8192 / (8*8192 + 5*512)
    assert row.startswith("| share of A |") and row.strip().endswith("96% |")


def test_measured_memory_is_quadratic_for_fused_and_linear_for_chunked():
    """The smallest of three runs each: another thread of the test process (a Dask client's, a browser driver's)
    may allocate while one runs, and tracemalloc counts that too."""
    lengths = (256, 512, 1024)
    peaks = cost.peak_memory_vs_length(lengths, d_model=32, n_heads=4, block=32, repeat=3)
    ks = {name: fit_exponent(lengths, ys) for name, ys in peaks.items()}
    fused, by_head, chunked = ks.values()
    assert fused > 1.7, ks
    assert by_head > 1.5, ks
    assert 0.8 < chunked < 1.2, ks
    assert peaks["head by head"][-1] < peaks["fused (layer.forward)"][-1] / 2


@pytest.mark.parametrize("make", [
    lambda: cost.plot_flops_vs_length(d_model=256, n_heads=4),
    lambda: cost.plot_kv_cache_vs_context(lengths=[256, 1024, 8192]),
    lambda: cost.plot_peak_memory([256, 512, 1024], {"a": [1e6, 4e6, 16e6], "b": [1e6, 2e6, 4e6]}),
    lambda: cost.plot_time_vs_length([64, 128, 256, 512], [1e-4, 3e-4, 1e-3, 4e-3], d_model=64, n_heads=4),
])
def test_figures_have_labelled_axes(make):
    _labelled(make())


def test_mistral_cache_stops_growing_at_its_window():
    fig = cost.plot_kv_cache_vs_context(lengths=[1024, 4096, 16384])
    mistral = next(line for line in fig.axes[0].lines if line.get_label().startswith("Mistral-7B"))
    y = mistral.get_ydata()
    assert y[1] == y[2] > y[0]


def test_each_model_line_ends_at_its_maximum_context():
    fig = cost.plot_kv_cache_vs_context(lengths=[256, 1024, 4096, 16384])
    lines = {line.get_label(): line for line in fig.axes[0].lines if not line.get_label().startswith("_")}
    for c in MODEL_CONFIGS.values():
        line = next(v for k, v in lines.items() if k.startswith(c.name + " ("))
        assert line.get_xdata()[-1] == c.max_context, c.name
