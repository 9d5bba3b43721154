"""The figures of the chapter on positions: RoPE's scores against the distance, decoding errors."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from mha_lab.cpu import apply_rope, rotation_matrix  # noqa: E402
from mha_lab.plots import positions  # noqa: E402


def test_rope_scores_are_the_rotated_dot_products_and_ignore_a_shift():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 16))
    distances = np.arange(5)
    got = positions.rope_scores(q, k, 3, distances)
    want = [(rotation_matrix(3, 16) @ q) @ (rotation_matrix(3 + n, 16) @ k) for n in distances]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(positions.rope_scores(q, k, 500, distances), got, rtol=1e-9)
    assert got[0] == np.dot(apply_rope(q[None], [3])[0], apply_rope(k[None], [3])[0])


def test_figures_have_labelled_axes_and_one_line_per_series():
    fig = positions.plot_rope_scores(dim=16, max_distance=20, shift=50)
    ax = fig.axes[0]
    assert ax.get_xlabel() and ax.get_ylabel()
    a, b = (line.get_ydata() for line in ax.lines[:2])
    np.testing.assert_allclose(a, b, atol=1e-9)  # the shifted query scores the same
    errors = {"correct": [0.0, 1e-16], "bug": [1e-16, 1.5]}
    fig = positions.plot_decode_errors(errors, [4, 5])
    lines = [line for line in fig.axes[0].lines if not line.get_label().startswith("_")]
    assert len(lines) == 2 and lines[0].get_ydata()[0] == 1e-17  # zeros drawn at the floor
