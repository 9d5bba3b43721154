"""The attention-pattern figures: right number of panels, labelled axes, bad input rejected."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mha_lab.plots.heads import plot_attention_heads, plot_toy_heads, plot_toy_training  # noqa: E402
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
    ax = plot_toy_training(runs).axes[0]
    assert len(ax.lines) == 2 and "loss" in ax.get_ylabel() and "step" in ax.get_xlabel()
