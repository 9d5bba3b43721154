"""The judge: the hidden checks of ``tests/hidden/test_<assignment>.py`` (loaded from its path), run in the
grader's process. A tests cell ``g`` is graded by ``test_<g>`` and ``test_<g>__<case>``, each called with
the ``student``: a kernel's namespace, or a ``remote.RemoteSubmission`` whose calls run in the sandbox.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import mha_lab
from mha_lab.grading.checks import clip

__all__ = ["HIDDEN_DIR_ENV", "hidden_module", "measures_memory", "load", "judge_cell", "run_hidden_checks"]

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


def measures_memory(path: Path) -> bool:
    """Whether the hidden checks at ``path`` measure memory (``checks.call_with_peak``)."""
    return "call_with_peak(" in Path(path).read_text()


def load(path: Path) -> ModuleType:
    """Execute the hidden module at ``path`` as a fresh module object (not entered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"hidden_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def judge_cell(module: ModuleType, name: str, student: Any) -> str:
    """Call every check of the tests cell ``name`` (``test_<name>`` and ``test_<name>__<case>``): '' when all
    pass, else a message for the feedback that names each failing check and the likely bug."""
    tests = [(k, v) for k, v in vars(module).items() if callable(v) and k.partition("__")[0] == f"test_{name}"]
    failures = [] if tests else [f"- no hidden checks for tests cell {name!r}: no points can be given"]
    for check, fn in tests:
        try:
            fn(student)
        except AssertionError as exc:
            failures.append(f"- {check}: {clip(str(exc)) or 'assertion failed'}")
        except Exception as exc:  # noqa: BLE001 - a check that cannot run gives no points, with its reason
            failures.append(f"- {check}: the check could not run ({type(exc).__name__}: {clip(str(exc))})")
    return "\n".join([f"{name}: {len(failures)} hidden check(s) failed", *failures]) if failures else ""


def run_hidden_checks(assignment: str, name: str, namespace: Mapping[str, Any]) -> None:
    """The instructor's check of a source notebook, in its kernel (the grader judges by grade_id instead)."""
    message = judge_cell(load(hidden_module(assignment)), name, namespace)
    if message:
        raise AssertionError(message)
