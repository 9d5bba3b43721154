"""The attention-pattern figures: right number of panels, labelled axes, bad input rejected."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mha_lab.plots.heads import plot_attention_heads, plot_toy_heads, plot_toy_training  # noqa: E402
from mha_lab.testing import assert_close  # noqa: E402
from mha_lab.toy import ToyTask, train_toy  # noqa: E402


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def test_one_panel_per_head_with_labelled_axes():
    A = np.random.default_rng(0).dirichlet(np.ones(5), size=(3, 5))  # (h, L, L), rows sum to 1
    fig = plot_attention_heads(A, labels=list("abcde"), annotate=True)
    panels = _panels(fig)
    assert len(panels) == 3
    for ax in panels:
        assert ax.get_xlabel() and ax.get_ylabel()
        assert [t.get_text() for t in ax.get_xticklabels()] == list("abcde")
    np.testing.assert_allclose(panels[1].images[0].get_array(), A[1])


def test_rejects_wrong_rank_and_title_count():
    with pytest.raises(ValueError, match="shape"):
        plot_attention_heads(np.ones((4, 4)))
    with pytest.raises(ValueError, match="titles"):
        plot_attention_heads(np.ones((2, 3, 3)) / 3, titles=["only one"])


def test_toy_figures():
    task = ToyTask(n_letters=5, n_digits=4, half=3)
    runs = {"1 head": train_toy(num_heads=1, d_model=8, steps=3, task=task),
            "2 heads": train_toy(num_heads=2, d_model=8, steps=3, task=task)}
    fig = plot_toy_heads(runs["2 heads"].model, runs["2 heads"].eval_batch)
    assert len(_panels(fig)) == 2
    assert _panels(fig)[0].images[0].get_array().shape == (task.half, task.seq_len)
    ax = plot_toy_training(runs, window=2).axes[0]
    assert len(ax.lines) == 4 and "loss" in ax.get_ylabel() and "step" in ax.get_xlabel()
    mean, raw = ax.lines[0], ax.lines[1]  # each run: its running mean, then its raw losses, faint
    losses = runs["1 head"].losses
    assert np.allclose(mean.get_ydata(), [(a + b) / 2 for a, b in zip(losses[:-1], losses[1:], strict=True)])
    assert np.allclose(raw.get_ydata(), losses) and raw.get_alpha() < 0.5


# mha_lab.plots.layout: the head-split memory figure of the reshape chapter


def test_describe_layout_reports_bytes_and_elements():
    from mha_lab.cpu import split_heads
    from mha_lab.plots.layout import describe_layout

    view = split_heads(np.zeros((2, 3, 6)), 2)  # (B, L, d_model) -> (B, h, L, d_k)
    info = describe_layout(view)
    assert info["strides (elements)"] == (18, 3, 6, 1)
    assert info["strides (bytes)"] == (144, 24, 48, 8)  # x8 for float64
    assert info["view"] and not info["C-contiguous"]
    assert describe_layout(np.ascontiguousarray(view))["C-contiguous"]


def test_head_split_layout_lists_offsets_in_visit_order():
    from mha_lab.plots.layout import plot_head_split_layout

    fig = plot_head_split_layout(seq_len=3, num_heads=2, d_k=3)
    bottom = [int(t.get_text()) for t in fig.axes[1].texts]
    assert bottom == [0, 1, 2, 6, 7, 8, 12, 13, 14, 3, 4, 5, 9, 10, 11, 15, 16, 17]
    assert all(ax.get_xlabel() for ax in fig.axes)


def test_loop_vs_fused_timing_records_and_figure(monkeypatch):
    from mha_lab.plots import layout
    from mha_lab.plots.layout import plot_loop_vs_fused, time_loop_vs_fused

    def fake_runs(fns, runs, repeat):
        """Runs each candidate once (both must compute the same layer) and reports known readings."""
        assert runs == 2 and repeat == 2
        assert_close(fns["loop"]()[0], fns["fused"]())
        return times.pop(0)

    times = [{"loop": [3.3, 3.0], "fused": [1.5, 1.6]}, {"loop": [12.0, 13.0], "fused": [1.5, 1.5]}]
    monkeypatch.setattr(layout, "fastest_runs", fake_runs)
    records = time_loop_vs_fused(head_counts=(1, 4), batch_size=1, seq_len=8, d_model=16, repeat=2)
    assert records == [{"heads": 1, "loop_s": 3.0, "fused_s": 1.5, "ratio": 2.0, "loop_runs": [3.3, 3.0],
                        "fused_runs": [1.5, 1.6]},
                       {"heads": 4, "loop_s": 12.0, "fused_s": 1.5, "ratio": 8.0, "loop_runs": [12.0, 13.0],
                        "fused_runs": [1.5, 1.5]}]
    ax = plot_loop_vs_fused(records).axes[0]
    assert len(ax.lines) == 2 and "(ms)" in ax.get_ylabel() and "heads" in ax.get_xlabel()
