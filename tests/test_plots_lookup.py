"""Chapter 1's first figures: the lookup, masking as renormalisation, heads split and merged."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mha_lab.cpu import softmax  # noqa: E402
from mha_lab.plots import lookup  # noqa: E402

TOKENS = ["the", "cat", "sat", "on", "the", "mat"]
SCORES = np.array([0.0, 2.25, 0.56, 0.0, 0.0, 1.12])


def _heights(ax) -> np.ndarray:
    return np.array([p.get_height() for p in ax.patches if p.get_facecolor()[3] > 0])


def test_lookup_shows_the_argmax_and_the_softmax():
    hard, soft = lookup.plot_lookup(TOKENS, SCORES, "cat").axes
    np.testing.assert_allclose(_heights(hard), [0, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(_heights(soft), softmax(SCORES))
    assert [t.get_text() for t in soft.get_xticklabels()] == TOKENS


def test_masking_renormalises_the_allowed_keys_to_the_masked_softmax():
    allowed = np.arange(6) <= 2
    full, kept, renormalised = lookup.plot_masking(TOKENS, SCORES, allowed, "sat").axes
    masked = softmax(SCORES + np.where(allowed, 0.0, -np.inf))
    np.testing.assert_allclose(_heights(renormalised), masked[allowed])
    assert _heights(kept).sum() < 1 and "sum" in kept.get_title()
    with pytest.raises(ValueError, match="one entry per token"):
        lookup.plot_masking(TOKENS, SCORES[:5], allowed, "sat")


def test_split_merge_boxes_each_head_and_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    X, concat = rng.standard_normal((2, 6, 4))
    A = softmax(rng.standard_normal((2, 6, 6)))
    fig = lookup.plot_split_merge(TOKENS, X, A, concat)
    assert [ax.get_title() for ax in fig.axes[:4]] == ["X, split in 2", "head 0", "head 1", "heads merged"]
    assert len(fig.axes[0].patches) == 2 and len(fig.axes[3].patches) == 2  # one box per head's slice
    with pytest.raises(ValueError, match="divisible by h"):
        lookup.plot_split_merge(TOKENS, X[:, :3], softmax(rng.standard_normal((2, 6, 6))), concat[:, :3])
