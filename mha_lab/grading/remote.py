"""Trusted re-judging: the student's code runs in its own process, the verdict is reached here.

A notebook can fool the checks that run inside its own kernel (replace ``run_hidden_checks``,
``np.allclose``...). ``rejudge`` runs the submission's code cells in a worker process
(``python -m mha_lab.grading.remote``), then runs each hidden check in the grader's process with a
``RemoteSubmission`` as the ``student`` fixture: step 2 of every check (the call) crosses to the
worker, steps 1 and 3 (inputs and judging) stay here. Values cross as JSON with arrays in
NumPy's ``.npy`` format, never as pickles, so the worker cannot run code in the grader.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["encode", "decode", "RemoteSubmission", "StudentProcess", "rejudge", "static_reference_use"]

# NumPy functions that may cross by name: pure reductions and ufuncs, nothing that touches files.
NUMPY_FUNCTIONS = frozenset({"sum", "mean", "std", "var", "max", "min", "prod", "median"})
CALL_TIMEOUT = 120.0  # seconds for one call of a student's function
START_TIMEOUT = 300.0  # seconds to run the notebook's cells


# --- a value codec that cannot execute code ---------------------------------------------------


def _npy(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _from_npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def _numpy_function(name: str) -> Any:
    """``np.<name>`` when it is a ufunc or one of ``NUMPY_FUNCTIONS``, else None."""
    fn = getattr(np, name, None) if isinstance(name, str) else None
    return fn if isinstance(fn, np.ufunc) or name in NUMPY_FUNCTIONS else None


def encode(value: Any, _arrays: dict[int, int] | None = None) -> Any:
    """A JSON-ready form of arrays, NumPy scalars and functions, numbers, strings, None, lists, tuples,
    dicts and ``checks.SmoothLoss``.

    An array met twice in one value (``(f, x)`` where f holds x) is sent once and referenced after,
    so the receiver sees one array, as the sender did.
    """
    from mha_lab.grading.checks import SmoothLoss

    arrays = {} if _arrays is None else _arrays
    if isinstance(value, np.ndarray):
        if id(value) in arrays:
            return {"__ref__": arrays[id(value)]}
        arrays[id(value)] = len(arrays)
        return {"__ndarray__": _npy(value)}
    if isinstance(value, np.generic):
        return {"__npscalar__": _npy(np.asarray(value))}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, arrays) for v in value]}
    if isinstance(value, list):
        return [encode(v, arrays) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, arrays), encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, SmoothLoss):
        return {"__smooth_loss__": encode(value.x, arrays)}
    if _numpy_function(getattr(value, "__name__", "")) is value:
        return {"__numpy__": value.__name__}  # by name: the receiver looks it up in its own NumPy
    return {"__unsupported__": type(value).__name__}


def decode(value: Any, _arrays: list[np.ndarray] | None = None) -> Any:
    """The inverse of ``encode``; an unsupported type comes back as a placeholder string."""
    from mha_lab.grading.checks import SmoothLoss

    arrays = [] if _arrays is None else _arrays
    if isinstance(value, list):
        return [decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "__ndarray__" in value:
        arrays.append(_from_npy(value["__ndarray__"]))
        return arrays[-1]
    if "__ref__" in value:
        return arrays[value["__ref__"]]
    if "__npscalar__" in value:
        return _from_npy(value["__npscalar__"])[()]
    if "__tuple__" in value:
        return tuple(decode(v, arrays) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k, arrays): decode(v, arrays) for k, v in value["__dict__"]}
    if "__smooth_loss__" in value:
        return SmoothLoss(decode(value["__smooth_loss__"], arrays))
    if "__numpy__" in value and _numpy_function(value["__numpy__"]) is not None:
        return _numpy_function(value["__numpy__"])
    return f"<unsupported value of type {value.get('__unsupported__', '?')}>"


# --- the worker: the student's side ------------------------------------------------------------


def _worker() -> None:
    """Serve requests on stdin; answers go to the original stdout, the student's prints to stderr."""
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from mha_lab.grading import checks

    namespace: dict[str, Any] = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "run":
            errors = []
            for source in request["cells"]:
                try:
                    exec(compile(source, "<submission>", "exec"), namespace)  # noqa: S102 - the student's own code
                except BaseException as exc:  # noqa: BLE001 - a broken cell is the student's problem, go on
                    errors.append(f"{type(exc).__name__}: {exc}")
            reply = {"ok": True, "errors": errors, "names": sorted(k for k in namespace if not k.startswith("_"))}
        else:
            student = checks.Submission(namespace, request["allowed"])
            try:
                args, kwargs = decode(request["arguments"])
                result, peak = checks.invoke(student, request["name"], args, kwargs, measure=request["measure"],
                                             replace=request["replace"])
                reply = {"ok": True, "result": encode(result), "peak": peak}
            except AssertionError as exc:
                reply = {"ok": False, "message": str(exc)}
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


# --- the grader's side --------------------------------------------------------------------------


class StudentProcess:
    """A worker process holding one submission's namespace."""

    def __init__(self, cells: Iterable[str], cwd: Path | None = None) -> None:
        env = {**os.environ, "MPLBACKEND": "Agg"}
        self.proc = subprocess.Popen([sys.executable, "-m", "mha_lab.grading.remote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd, env=env)
        reply = self.request({"op": "run", "cells": list(cells)}, START_TIMEOUT)
        self.names = set(reply.get("names", ()))

    def request(self, message: dict, timeout: float) -> dict:
        """Send one request and wait for its answer; AssertionError when the worker dies or hangs."""
        if self.proc.poll() is not None:
            raise AssertionError("the submission's process has exited (did the code call exit() or crash?)")
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"no answer from the submission within {timeout:.0f} s (it hung or crashed)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RemoteSubmission(Mapping):
    """The ``student`` fixture in trusted mode: calls run in the worker, results are judged here."""

    def __init__(self, process: StudentProcess, allowed: Iterable[str], source: str) -> None:
        self.process, self.allowed, self.source = process, frozenset(allowed), source

    def remote_call(self, name: str, args: tuple, kwargs: dict, *, measure: bool,
                    replace: dict[str, str]) -> tuple[Any, int | None]:
        used = static_reference_use(self.source, name, self.allowed)
        if used:
            raise AssertionError(f"`{name}` uses {used} instead of implementing it: no points for `{name}`")
        reply = self.process.request({"op": "call", "name": name, "arguments": encode((args, kwargs)),
                                      "measure": measure, "replace": replace, "allowed": sorted(self.allowed)},
                                     CALL_TIMEOUT)
        if not reply["ok"]:
            raise AssertionError(reply["message"])
        return decode(reply["result"]), reply["peak"]

    def __getitem__(self, key: str) -> Any:
        if key not in self.process.names:
            raise KeyError(key)
        return f"<{key} in the submission's process>"

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.process.names))

    def __len__(self) -> int:
        return len(self.process.names)


def static_reference_use(source: str, name: str, allowed: frozenset[str]) -> str:
    """Read the submission's source (never run here): does function ``name`` reach a forbidden mha_lab name?

    Looks at names imported from mha_lab anywhere in the notebook and at ``mha_lab.<...>.<x>``
    attribute chains, inside ``name`` and the notebook functions it calls.
    """
    from mha_lab.grading.checks import _reference_names

    forbidden = _reference_names(allowed)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    imported: dict[str, str] = {}  # local name -> forbidden mha_lab name
    modules = {"mha_lab"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mha_lab"):
            for alias in node.names:
                if alias.name in forbidden:
                    imported[alias.asname or alias.name] = alias.name
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("mha_lab"))
    seen, todo = set(), [name]
    while todo:
        fn = functions.get(todo.pop())
        if fn is None or fn.name in seen:
            continue
        seen.add(fn.name)
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id in imported:
                return f"{forbidden[imported[node.id]]}.{imported[node.id]}"
            if isinstance(node, ast.Attribute) and node.attr in forbidden and _root(node) in modules:
                return f"{forbidden[node.attr]}.{node.attr}"
            if isinstance(node, ast.Name) and node.id in functions:
                todo.append(node.id)
    return ""


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def submission_cells(path: Path) -> list[str]:
    """The code cells to run in the worker: everything but the autograder tests cells."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells
            if c.cell_type == "code" and not c.metadata.get("nbgrader", {}).get("grade", False)
            and not c.source.lstrip().startswith(("%", "!"))]


def rejudge(course: Path, assignment: str, result: Any) -> None:
    """Re-run the hidden checks of every tests cell against the submission, judged here.

    A cell that fails here loses its points in ``result`` and in the gradebook (nbgrader's
    ``manual_score``), so feedback and export agree. In-kernel failures are kept as they are.
    """
    from nbgrader.api import Gradebook

    from mha_lab.grading.batch import COURSE_ID
    from mha_lab.grading.runner import NoHiddenChecksError, failure_message, run_group

    folder = Path(course) / "submitted" / result.student / assignment
    overrides = []
    for path in sorted(folder.glob("*.ipynb")):
        cells = submission_cells(path)
        try:
            process = StudentProcess(cells, cwd=folder)
        except AssertionError as exc:  # the notebook's code does not even run outside its kernel
            for cell in result.cells:
                if cell.score > 0:
                    cell.message, cell.score = f"trusted re-judging: {exc}", 0.0
                    overrides.append((cell.grade_id, path.stem))
            continue
        try:
            for cell in result.cells:
                if cell.score == 0:
                    continue
                try:
                    failures = run_group(assignment, cell.grade_id,
                                         lambda allowed, p=process, c=cells: RemoteSubmission(p, allowed, "\n".join(c)))
                except NoHiddenChecksError:  # this cell is graded by its visible asserts alone: that verdict stands
                    continue
                except RuntimeError as exc:  # the checks did not run: unverified points are not given
                    failures = [("hidden checks", str(exc).splitlines()[0])]
                if failures:
                    cell.message = "trusted re-judging: " + failure_message(assignment, cell.grade_id, failures)
                    cell.score = 0.0
                    overrides.append((cell.grade_id, path.stem))
        finally:
            process.close()
    result.score = sum(c.score for c in result.cells)
    with Gradebook(f"sqlite:///{Path(course) / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        for grade_id, notebook in overrides:
            gb.find_grade(grade_id, notebook, assignment, result.student).manual_score = 0.0
        gb.db.commit()


if __name__ == "__main__":
    _worker()
