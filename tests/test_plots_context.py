"""The context-parallel figures: the zigzag schedule's colours and steps, the work per rank, the timing panels."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from mha_lab.plots.context import causal_pairs_per_rank, plot_cp_step, plot_zigzag_schedule  # noqa: E402


def test_zigzag_balances_the_causal_work_and_contiguous_does_not():
    for n in (1, 2, 3, 4, 8):
        assert np.array_equal(causal_pairs_per_rank(n), np.full(n, 2.0 * n))  # r + 0.5 + (2N-1-r) + 0.5
        assert np.array_equal(causal_pairs_per_rank(n, zigzag=False), 4.0 * np.arange(n) + 2)
    assert causal_pairs_per_rank(4).sum() == causal_pairs_per_rank(4, zigzag=False).sum() == 8 * 8 / 2


def test_schedule_colours_each_kept_block_by_its_rank_and_numbers_its_step():
    fig = plot_zigzag_schedule(3)
    matrix, bars = fig.axes[:2]
    owner = matrix.images[0].get_array() - 1  # -1: hidden by the mask
    assert owner.shape == (6, 6)
    assert np.array_equal(owner[np.triu_indices(6, 1)], np.full(15, -1))
    assert [owner[i, 0] for i in range(6)] == [0, 1, 2, 2, 1, 0]  # rank r holds chunks r and 2N-1-r
    steps = [int(t.get_text()) for t in matrix.texts]
    assert len(steps) == 21 and sorted(set(steps)) == [0, 1, 2]
    assert matrix.get_xlabel() and bars.get_ylabel() and len(bars.patches) == 6


def test_step_figure_has_a_bar_per_mode_and_rank_count():
    rows = [{"mode": m, "world_size": n, "seconds": 0.01 * n, "comm_share": 0.1 * n}
            for m in ("ring", "ulysses") for n in (1, 2, 4)]
    left, right = plot_cp_step(rows).axes[:2]
    assert len(left.patches) == len(right.patches) == 6
    assert [round(p.get_height(), 6) for p in right.patches[:3]] == [10, 20, 40]
    assert "ms" in left.get_ylabel() and "%" in right.get_ylabel()
