"""Grading: the hidden checks behind the nbgrader notebooks, and the batch grader.

A hidden tests cell calls ``run_hidden_checks("ps2_mqa", "mqa_forward_shape", globals())``.
``python -m mha_lab.grading.batch <assignment>`` (``make grade A=...``) grades a class.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["run_hidden_checks"]

# Modules the checks rely on. They are imported afresh for every run, so that a notebook that
# replaced one of their functions (a helper, a reference implementation) cannot change a verdict.
_FRESH = ("mha_lab.grading.", "mha_lab.testing", "mha_lab.cpu", "mha_lab.analysis", "mha_lab.gradcheck")


def run_hidden_checks(assignment: str, group: str, namespace: Mapping[str, Any]) -> None:
    """Run the hidden checks ``test_<group>*`` of ``tests/hidden/test_<assignment>.py`` on ``namespace``.

    Returns quietly when every check passes; otherwise raises AssertionError whose message
    lists each failing check and the likely bug (nbgrader shows it as the cell's feedback).
    """
    for name in [n for n in sys.modules if n.startswith(_FRESH)]:
        del sys.modules[name]
    runner = importlib.import_module("mha_lab.grading.runner")
    runner.run_in_kernel(assignment, group, namespace)
