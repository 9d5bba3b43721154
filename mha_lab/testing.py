"""Tolerances by dtype, shared by the test suite, the hidden grading checks and the book."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from mha_lab.analysis import DType

__all__ = ["tolerances", "assert_close", "GRADCHECK_EPS", "GRADCHECK_MAX_REL_ERROR"]

GRADCHECK_EPS = 1e-5  # central-difference step
GRADCHECK_MAX_REL_ERROR = 1e-5  # pass mark for relative error

_TOLERANCES = {
    "float64": {"rtol": 1e-10, "atol": 1e-12},
    "float32": {"rtol": 1e-5, "atol": 1e-5},
}


def tolerances(dtype: DType) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for comparing two results computed in ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _TOLERANCES:
        raise ValueError(f"no tolerance policy for {dtype}; fp16/bf16 are judged against plain PyTorch's error")
    return dict(_TOLERANCES[name])


def assert_close(actual: ArrayLike, expected: ArrayLike, dtype: DType | None = None, err_msg: str = "") -> None:
    """``np.testing.assert_allclose`` with the tolerance of ``dtype`` (default: ``actual``'s dtype)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    np.testing.assert_allclose(actual, expected, err_msg=err_msg, **tolerances(dtype or actual.dtype))
