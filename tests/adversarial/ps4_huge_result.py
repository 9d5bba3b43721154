"""Answer with a 1.5 GiB array of the wrong shape, so that the reply from the worker is enormous.

Stopped by: the worker's memory cap and a bounded reply; the grader's judging never holds the whole of it.
"""

ASSIGNMENT = "ps4_backward"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import numpy as np

    def _huge(*args, **kwargs):
        return np.ones(3 * 2**26)  # 1.5 GiB of float64

    mha_backward = numerical_gradient = gradient_check = _huge  # noqa: F841 - module-level names in the notebook
