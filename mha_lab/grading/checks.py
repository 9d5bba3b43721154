"""The helpers every hidden check is written with: call the student's function, then judge it.

A hidden check has three separate steps, so that the call can run in the sandbox and the
judging in the grader (see ``mha_lab.grading.worker``):

1. make the inputs (seeded ``numpy.random.Generator``, shapes the visible tests do not use);
2. ``out = call(student, "name", *args)``: run the student's function, refusing answers
   taken from ``mha_lab`` (``reference_use``);
3. judge with ``expect_array`` / ``expect_close`` / ``expect_true`` / ``expect_within_budget``.

Every failure is an ``AssertionError`` whose message names the property and the likely bug, and ends
with the bug's stable id, ``[bug: <id>]`` (``BUG_TAG``; every hint of a hidden check ends with one): the
class report groups failures by these ids, so rewording a hint never splits or merges its group.
"""

from __future__ import annotations

import ast
import copy
import importlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mha_lab.measure import traced_memory
from mha_lab.testing import tolerances

__all__ = ["BUG_TAG", "bug_ids", "Submission", "call", "call_with_peak", "call_replacing", "invoke", "run",
           "reference_use", "expect_array", "expect_close", "expect_true", "expect_within_budget",
           "SmoothLoss"]

# The public names of mha_lab (and of torch) that compute attention or its pieces for you; an assignment
# allows a few of them (``ALLOWED_HELPERS`` in its hidden module). ``mha_lab.cuda`` is refused whole, by
# name (importing it to list its names would cost seconds of torch).
REFERENCE_MODULES = ("mha_lab.cpu", "mha_lab.analysis", "mha_lab.gradcheck")
TORCH_REFERENCES = {"torch.nn.functional": ("scaled_dot_product_attention", "multi_head_attention_forward"),
                    "torch.nn": ("MultiheadAttention",)}


BUG_TAG = re.compile(r"\[bug: ([a-z0-9]+(?:-[a-z0-9]+)*)\]")  # a likely bug's stable id, e.g. [bug: scale-d-model]


def bug_ids(message: str) -> list[str]:
    """The bug ids a failure message names, in order ([] when it names none)."""
    return BUG_TAG.findall(message)


class Submission(dict):
    """The student's namespace, the mha_lab names the assignment allows (``create_causal_mask``...:
    the rest of ``REFERENCE_MODULES`` is the answer), and the notebook's cells ``reference_use`` reads."""

    def __init__(self, namespace: Mapping[str, Any], allowed: Iterable[str] = (), cells: Sequence[str] = ()) -> None:
        super().__init__(namespace)
        self.allowed, self.cells = frozenset(allowed), tuple(cells)


def call(student: Mapping[str, Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """Step 2 of a check: run the student's ``name(*args, **kwargs)`` and return its result.

    Fails when ``name`` is missing, still raises NotImplementedError, raises anything else,
    or takes its answer from mha_lab (``reference_use``). A remote submission
    (``mha_lab.grading.worker``) runs the call in the student's sandbox instead of here.
    """
    return invoke(student, name, args, kwargs)[0]


def call_with_peak(student: Mapping[str, Any], name: str, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Like ``call``, and also return the peak bytes the call allocated: read from outside the sandbox when it
    runs in one with a memory cgroup (``worker.RemoteSubmission``), else with tracemalloc."""
    return invoke(student, name, args, kwargs, measure=True)


def call_replacing(student: Mapping[str, Any], replace: Mapping[str, str], name: str,
                   *args: Any, **kwargs: Any) -> Any:
    """Like ``call``, with some of the student's helpers swapped for references during the call.

    ``replace`` maps a notebook name to a dotted path, e.g. ``{"attention":
    "mha_lab.cpu.scaled_dot_product_attention"}``: the loop that calls ``attention`` is then
    judged on its own, and a bug in ``attention`` is not charged twice.
    """
    return invoke(student, name, args, kwargs, replace=replace)[0]


def invoke(student: Mapping[str, Any], name: str, args: tuple, kwargs: dict, *, measure: bool = False,
           replace: Mapping[str, str] | None = None) -> tuple[Any, int | None]:
    """The one way a check runs student code: returns ``(result, peak bytes or None)``.

    The submission's source is read first (``reference_use``); a remote submission
    (``mha_lab.grading.worker``) then runs the call in its sandbox, any other runs it here.
    """
    replace = dict(replace or {})
    used = reference_use(getattr(student, "cells", ()), name, getattr(student, "allowed", ()), skip=replace)
    if used:
        raise AssertionError(f"`{name}` uses {used} instead of implementing it: no points for `{name}`"
                             " [bug: uses-mha-lab]")
    if hasattr(student, "remote_call"):
        return student.remote_call(name, args, kwargs, measure=measure, replace=replace)
    args, kwargs = copy.deepcopy((args, kwargs))  # the student's code may write into its inputs
    return run(student, name, args, kwargs, measure=measure, replace=replace)


def run(namespace: Mapping[str, Any], name: str, args: tuple, kwargs: dict, *, measure: bool = False,
        replace: Mapping[str, str] | None = None) -> tuple[Any, int | None]:
    """Call ``namespace[name]`` with the helpers in ``replace`` swapped for references, turning the student's
    errors into messages that say what happened; with ``measure``, also return its tracemalloc peak (the
    worker's own measurement, used where no cgroup reads it)."""
    fn = namespace.get(name)
    if not callable(fn):
        raise AssertionError(f"`{name}` should be a function, got {type(fn).__name__} [bug: not-a-function]"
                             if name in namespace else f"`{name}` is not defined: run the cell that defines it, "
                             "and keep its name [bug: not-defined]")
    scope = getattr(fn, "__globals__", {})
    saved = {attr: scope[attr] for attr in (replace or {}) if attr in scope}
    for attr in saved:
        module, _, func = replace[attr].rpartition(".")
        scope[attr] = getattr(importlib.import_module(module), func)
    result: list[Any] = []  # the measured call's result
    try:
        peak = traced_memory(lambda: result.append(fn(*args, **kwargs)))[1] if measure else None
        return (result[0] if measure else fn(*args, **kwargs)), peak
    except NotImplementedError:
        raise AssertionError(f"`{name}` is not implemented yet (NotImplementedError) [bug: not-implemented]") from None
    except TypeError as exc:
        raise AssertionError(f"`{name}` raised TypeError: {exc} (check its signature) [bug: signature]") from None
    except Exception as exc:  # noqa: BLE001 - any error of the student's code loses the points, with its reason
        raise AssertionError(f"`{name}` raised {type(exc).__name__}: {exc} [bug: raises-{type(exc).__name__.lower()}]"
                             ) from None
    finally:
        scope.update(saved)


# --- refusing answers taken from mha_lab -------------------------------------------------------

# Names that run code built at run time or reach modules by name: a notebook that uses them
# cannot be read for what it calls, so its functions are not graded.
DYNAMIC = frozenset({"exec", "eval", "compile", "__import__", "importlib", "runpy", "__builtins__", "builtins",
                     "modules", "pickle", "marshal", "ctypes", "get_ipython", "FunctionType", "CodeType"})


def _reference_names(allowed: frozenset[str]) -> dict[str, str]:
    """Forbidden public names -> the module that provides them (e.g. 'split_heads' -> 'mha_lab.cpu')."""
    names: dict[str, str] = {}
    for mod_name in REFERENCE_MODULES:
        for attr in getattr(importlib.import_module(mod_name), "__all__", ()):
            if attr not in allowed:
                names.setdefault(attr, mod_name)
    for mod_name, attrs in TORCH_REFERENCES.items():
        names.update(dict.fromkeys(attrs, mod_name))
    return names


def reference_use(cells: Sequence[str], name: str, allowed: Iterable[str] = (), skip: Iterable[str] = ()) -> str:
    """Read the notebook's code cells (never run them): what ``name`` takes from mha_lab instead of computing.

    Looks at ``name`` and every function of the cells it reaches (but those in ``skip``): names
    imported from mha_lab or torch, ``mha_lab.<...>.<x>`` chains, ``getattr`` on such a module,
    anything of ``mha_lab.cuda``; and, anywhere in the cells, code that reaches modules by name
    (``DYNAMIC``) or names an mha_lab module in a string. Returns '' when it finds none.
    """
    trees = []
    for cell in cells:
        try:
            trees.append(ast.parse(cell))
        except SyntaxError:  # the worker cannot run it either
            continue
    nodes = [node for tree in trees for node in ast.walk(tree)]
    for node in nodes:
        if isinstance(node, ast.Name | ast.Attribute) and (getattr(node, "id", None) or node.attr) in DYNAMIC:
            return f"`{getattr(node, 'id', None) or node.attr}` (code that cannot be read before it runs)"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "mha_lab." in node.value:
            return f"{node.value!r} (a module named in a string)"
    forbidden = _reference_names(frozenset(allowed))
    defs: dict[str, list[ast.AST]] = {}  # a global name -> the functions, classes and assignments that define it
    for n in (statement for tree in trees for statement in tree.body):
        for target in [n] if isinstance(n, ast.FunctionDef | ast.ClassDef) else getattr(n, "targets", []):
            defs.setdefault(getattr(target, "name", None) or getattr(target, "id", ""), []).append(n)
    imported: dict[str, str] = {}  # local name -> the module.name it stands for
    modules = {"mha_lab", "torch"}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("mha_lab", "torch")):
            for alias in node.names:
                if node.module.startswith("mha_lab.cuda") or alias.name in forbidden or alias.name == "cuda":
                    imported[alias.asname or alias.name] = f"{forbidden.get(alias.name, node.module)}.{alias.name}"
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names
                           if a.name.startswith(("mha_lab", "torch")))
    seen, todo = set(), list(defs.get(name, []))
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        local = {n.arg for n in ast.walk(fn) if isinstance(n, ast.arg)}  # names that shadow the globals
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                  and isinstance(fn, ast.FunctionDef)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id in imported:
                return imported[node.id]
            if isinstance(node, ast.Attribute) and _root(node) in modules and (node.attr in forbidden
                                                                               or node.attr == "cuda"):
                return f"{forbidden.get(node.attr, 'mha_lab')}.{node.attr}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and node.args and _root(node.args[0]) in modules):
                return f"getattr on {_root(node.args[0])}"
            if isinstance(node, ast.Name) and node.id not in skip and node.id not in local:
                todo += defs.get(node.id, [])
    return ""


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


# --- judging -------------------------------------------------------------------------------------


NONFINITE = "overflow in exp (softmax without subtracting the max?) or a wrong mask [bug: nonfinite]"


def expect_array(value: Any, *, what: str, shape: tuple[int, ...], dtype: Any = np.float64,
                 hint: str = NONFINITE) -> np.ndarray:
    """Type, shape, dtype and finiteness, in that order, each failure naming ``what``; ``hint`` is the
    likely bug when entries are NaN or inf."""
    if type(value) is not np.ndarray:
        raise AssertionError(f"{what}: expected a numpy.ndarray, got {type(value).__name__} [bug: not-an-array]")
    if value.shape != tuple(shape):
        raise AssertionError(f"{what}: expected shape {tuple(shape)}, got {value.shape} [bug: wrong-shape]")
    if dtype is not None and value.dtype != np.dtype(dtype):
        raise AssertionError(f"{what}: expected dtype {np.dtype(dtype)}, got {value.dtype} [bug: wrong-dtype]")
    if not np.isfinite(value).all():
        bad = int(np.size(value) - np.isfinite(value).sum())
        raise AssertionError(f"{what}: {bad} entries are NaN or inf. Likely bug: {hint}")
    return value


def expect_close(actual: np.ndarray, expected: np.ndarray, *, what: str, hint: str) -> None:
    """Values within ``mha_lab.testing.tolerances`` of the reference; else name the likely bug."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {expected.shape}, got {actual.shape} [bug: wrong-shape]")
    tol = tolerances(expected.dtype)
    err = np.abs(actual - expected)
    if not (err <= tol["atol"] + tol["rtol"] * np.abs(expected)).all():
        raise AssertionError(
            f"{what}: values differ from the reference (max abs error {float(err.max()):.3g}). "
            f"Likely bug: {hint}"
        )


def expect_true(condition: bool, *, what: str, hint: str) -> None:
    """A property that is not a comparison of arrays (e.g. 'returns a list of h matrices')."""
    if not condition:
        raise AssertionError(f"{what}. Likely bug: {hint}")


def expect_within_budget(peak: int, budget: int, *, what: str, hint: str) -> None:
    """Peak memory at most ``budget`` bytes, e.g. less than one full (B, h, L, L) score matrix."""
    if peak > budget:
        raise AssertionError(
            f"{what}: peak memory {peak / 2**20:.2f} MiB is over the budget of {budget / 2**20:.2f} MiB. "
            f"Likely bug: {hint}"
        )


class SmoothLoss:
    """A scalar test function of the array it holds: f() = sum(sin(x) x^2), exact gradient cos(x) x^2 + 2 x sin(x).

    An object, not a closure, so that it can cross to the sandboxed worker together with the very
    ``x`` a student's finite-difference code perturbs (the value codec keeps the two the same array).
    """

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def __call__(self) -> float:
        return float(np.sum(np.sin(self.x) * self.x**2))

    def exact(self) -> np.ndarray:
        return np.cos(self.x) * self.x**2 + 2 * self.x * np.sin(self.x)
