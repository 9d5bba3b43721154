"""The judge: the hidden checks of ``tests/hidden/test_<assignment>.py``, run in the grader's process.

A tests cell with grade_id ``g`` is graded by the module's functions ``test_<g>`` and
``test_<g>__<case>``, each called with the ``student`` (a ``checks.Submission`` here, or a
``worker.RemoteSubmission`` whose calls run in the sandbox). The module is loaded from its path,
never looked up by name, and a module may set ``ALLOWED_HELPERS``: the mha_lab names students may use.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import mha_lab
from mha_lab.grading import checks

__all__ = ["HIDDEN_DIR_ENV", "hidden_module", "load", "judge_cell", "run_hidden_checks"]

HIDDEN_DIR_ENV = "MHA_LAB_HIDDEN_DIR"


def hidden_module(assignment: str, course: Path | None = None) -> Path:
    """``$MHA_LAB_HIDDEN_DIR``, else the course's ``tests/hidden``, else the one beside mha_lab."""
    folders = [Path(os.environ[HIDDEN_DIR_ENV])] if os.environ.get(HIDDEN_DIR_ENV) else []
    folders += [Path(course) / "tests" / "hidden"] if course else []
    folders += [Path(mha_lab.__file__).resolve().parents[1] / "tests" / "hidden"]
    path = next((f / f"test_{assignment}.py" for f in folders if (f / f"test_{assignment}.py").is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no hidden checks for assignment {assignment!r} in {folders[0]}")
    return path


def load(path: Path) -> ModuleType:
    """Execute the hidden module at ``path`` as a fresh module object (not entered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"hidden_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _describe(value: Any) -> str:
    """An input as the feedback shows it: an array by shape and dtype, a short value by its repr."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"array {tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


class _ShowingInputs(dict):
    """A remote student whose failing calls say what they were given: when the student's function raises,
    the message adds the shapes of its inputs (the sandbox only sees the call, the judge its arguments)."""

    def __init__(self, student: Mapping[str, Any]) -> None:
        super().__init__(student)
        self._student = student

    def __getattr__(self, name: str) -> Any:  # cells, allowed, ...: the remote student's own
        return getattr(self._student, name)

    def remote_call(self, name: str, args: tuple, kwargs: dict, **options: Any) -> Any:
        try:
            return self._student.remote_call(name, args, kwargs, **options)
        except AssertionError as exc:
            if f"`{name}` raised " not in str(exc):
                raise
            given = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
            raise AssertionError(f"{exc} (called with {', '.join(given) or 'no arguments'})") from None


def judge_cell(module: ModuleType, name: str, student: Mapping[str, Any]) -> str:
    """Call every check of the tests cell ``name`` (``test_<name>`` and ``test_<name>__<case>``): '' when all
    pass, else a message for the feedback that names each failing check and the likely bug."""
    student = _ShowingInputs(student) if hasattr(student, "remote_call") else student
    tests = [(k, v) for k, v in vars(module).items() if callable(v) and k.partition("__")[0] == f"test_{name}"]
    failures = [] if tests else [f"- no hidden checks for tests cell {name!r}: no points can be given"]
    for check, fn in tests:
        try:
            fn(student)
        except AssertionError as exc:
            failures.append(f"- {check}: {str(exc) or 'assertion failed'}")
        except Exception as exc:  # noqa: BLE001 - a check that cannot run gives no points, with its reason
            failures.append(f"- {check}: the check could not run ({type(exc).__name__}: {exc})")
    return "\n".join([f"{name}: {len(failures)} hidden check(s) failed", *failures]) if failures else ""


def run_hidden_checks(assignment: str, name: str, namespace: Mapping[str, Any]) -> None:
    """The instructor's check of a source notebook, in its own kernel: AssertionError when a check fails.

    The grader never runs this line: it judges each tests cell by its grade_id, outside the sandbox.
    """
    module = load(hidden_module(assignment))
    cells = [c for c in namespace.get("In", ()) if "run_hidden_checks" not in c]  # IPython's inputs
    message = judge_cell(module, name, checks.Submission(namespace, getattr(module, "ALLOWED_HELPERS", ()), cells))
    if message:
        raise AssertionError(message)
