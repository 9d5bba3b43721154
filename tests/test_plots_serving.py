"""The figures of the serving chapter: labelled, data as given, in the units their axes name."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from mha_lab.plots import serving  # noqa: E402


def test_cascade_bytes_plots_megabytes():
    fig = serving.plot_cascade_bytes([1, 4], [2e6, 8e6], [2.1e6, 2.4e6])
    ax = fig.axes[0]
    assert ax.get_xlabel() and "MB" in ax.get_ylabel()
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [2, 8])
    np.testing.assert_allclose(ax.lines[1].get_ydata(), [2.1, 2.4])


def test_step_cost_shows_one_bar_per_part():
    flops = {"weights": 2e12, "attention": 4e10}
    fig = serving.plot_step_cost(flops, {"weights": 16e9, "K/V": 1e8})
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == list(flops)
    np.testing.assert_allclose([p.get_width() for p in left.patches], [2000, 40])
    np.testing.assert_allclose([p.get_width() for p in right.patches], [16, 0.1])


def test_speculative_plots_measured_and_expected():
    fig = serving.plot_speculative([1, 2], [0.8, 0.7], [1.8, 2.2], [1.8, 2.19], {"c = 0.1": [1.6, 1.8]})
    left, right = fig.axes
    np.testing.assert_allclose(left.lines[0].get_ydata(), [1.8, 2.2])
    np.testing.assert_allclose(right.lines[0].get_ydata(), [1.6, 1.8])
