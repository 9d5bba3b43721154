"""The figures of the decoding chapter: labelled, one series per method, data as given."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from mha_lab.cpu import create_causal_mask  # noqa: E402
from mha_lab.cpu.rope_scaling import interpolation_frequencies, rope_frequencies  # noqa: E402
from mha_lab.cpu.window import sink_mask  # noqa: E402
from mha_lab.plots import decoding  # noqa: E402


def test_paged_waste_plots_percentages():
    fig = decoding.plot_paged_waste([1, 16, 64], [0.0, 0.01, 0.05], 0.5)
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel()
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [0, 1, 5])
    np.testing.assert_allclose(ax.lines[1].get_ydata(), [50, 50])


def test_kept_keys_shows_one_panel_per_rule():
    masks = {"causal": create_causal_mask(6)[0, 0], "sinks": sink_mask(6, 2, 1)[0, 0]}
    fig = decoding.plot_kept_keys(masks)
    assert [ax.get_title() for ax in fig.axes] == list(masks)
    np.testing.assert_array_equal(fig.axes[1].images[0].get_array(), masks["sinks"] == 0)


def test_rope_scaling_plots_wavelengths_and_scores():
    freqs = {"base": rope_frequencies(16), "PI": interpolation_frequencies(16, 4)}
    fig = decoding.plot_rope_scaling(freqs, train_len=100, max_distance=400)
    left, right = fig.axes
    np.testing.assert_allclose(left.lines[1].get_ydata(), 2 * np.pi / freqs["PI"])
    assert right.lines[0].get_ydata()[0] == 1.0 and len(right.lines) == 3  # two methods, the training length
