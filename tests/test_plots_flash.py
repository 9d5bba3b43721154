"""FlashAttention's figures and table: one tile's state, traffic against fast memory, formula against simulation."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from mha_lab.plots import flash  # noqa: E402
from mha_lab.traffic import tile_shape  # noqa: E402


def test_tile_state_figure_draws_one_point_per_key_tile():
    Q, K, V = np.random.default_rng(0).standard_normal((3, 40, 4))
    fig = flash.plot_tile_state(Q, K, V, sram=120)
    tiles = -(-40 // tile_shape(4, 120)[1])
    m_panel, l_panel, out_panel = fig.axes
    assert len(l_panel.lines[0].get_xdata()) == tiles
    assert all(ax.get_xlabel() == "key tiles seen" and ax.get_ylabel() for ax in fig.axes)
    last = [line.get_ydata()[-1] for line in out_panel.lines if len(line.get_xdata()) == tiles]
    dashed = [line.get_ydata()[0] for line in out_panel.lines if line.get_linestyle() == "--"]
    np.testing.assert_allclose(last, dashed)  # the running output ends on the exact output


def test_traffic_table_shows_the_formula_equal_to_the_simulation():
    table = flash.traffic_table(96, 8, [600, 2000])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    assert len(rows) == 8  # three algorithms with the paper's tiles, FlashAttention-2 with square ones
    assert [r[1] for r in rows[:4]] == ["19 x 8"] * 3 + ["12 x 12"] and rows[3][2] == "FlashAttention-2 (square)"
    assert all(r[4] == "0" for r in rows)  # the simulation counts what the formula says
    assert all(r[5] == "0%" for r in rows if "Flash" in r[2])


def test_traffic_figure_has_three_algorithms_and_a_slope_guide():
    fig = flash.plot_traffic_vs_fast_memory(4096, 64, [2**13, 2**14, 2**15])
    ax = fig.axes[0]
    assert len(ax.lines) == 5 and "square tiles" in ax.lines[3].get_label()
    assert "MiB" in ax.get_ylabel() and "KiB" in ax.get_xlabel()
