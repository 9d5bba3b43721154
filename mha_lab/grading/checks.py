"""The helpers every hidden check is written with: call the student's function, then judge it.

A hidden check has three separate steps, so that the call can run in another process than
the judging (see ``mha_lab.grading.remote``):

1. make the inputs (seeded ``numpy.random.Generator``, shapes the visible tests do not use);
2. ``out = call(student, "name", *args)``: look the function up and run it, refusing answers
   taken from ``mha_lab`` (``forbid_reference``);
3. judge with ``expect_array`` / ``expect_close`` / ``expect_true`` / ``expect_within_budget``.

Every failure is an ``AssertionError`` whose message names the property and the likely bug.
"""

from __future__ import annotations

import copy
import importlib
import sys
import tracemalloc
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from mha_lab.testing import tolerances

__all__ = [
    "Submission",
    "call",
    "call_with_peak",
    "call_replacing",
    "invoke",
    "forbid_reference",
    "expect_array",
    "expect_close",
    "expect_true",
    "peak_bytes",
    "expect_within_budget",
    "SmoothLoss",
]

# The public names of mha_lab (and of torch) that compute attention or its pieces for you.
# An assignment allows a few of them (``ALLOWED_HELPERS`` in its hidden module).
REFERENCE_MODULES = ("mha_lab.cpu", "mha_lab.analysis", "mha_lab.cuda", "mha_lab.gradcheck")
TORCH_REFERENCES = {
    "torch.nn.functional": ("scaled_dot_product_attention", "multi_head_attention_forward"),
    "torch.nn": ("MultiheadAttention",),
}
_METHODS = ("forward", "backward", "__call__")


class Submission(dict):
    """The student's notebook namespace, plus the mha_lab names this assignment allows.

    ``allowed`` lists public mha_lab names the student may call (e.g. ``create_causal_mask``);
    everything else in ``REFERENCE_MODULES`` counts as taking the answer from the package.
    """

    def __init__(self, namespace: Mapping[str, Any], allowed: Iterable[str] = ()) -> None:
        super().__init__(namespace)
        self.allowed = frozenset(allowed)


def _lookup(student: Mapping[str, Any], name: str) -> Callable:
    if name not in student:
        raise AssertionError(f"`{name}` is not defined: run the cell that defines it, and keep its name")
    fn = student[name]
    if not callable(fn):
        raise AssertionError(f"`{name}` should be a function, got {type(fn).__name__}")
    return fn


def _run(name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Call ``fn`` and turn the usual student-side errors into messages that say what happened."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise AssertionError(f"`{name}` is not implemented yet (NotImplementedError)") from None
    except TypeError as exc:
        raise AssertionError(f"`{name}` raised TypeError: {exc} (check its signature)") from None
    except Exception as exc:  # noqa: BLE001 - any error of the student's code loses the points, with its reason
        raise AssertionError(f"`{name}` raised {type(exc).__name__}: {exc}") from None


def call(student: Mapping[str, Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """Step 2 of a check: run the student's ``name(*args, **kwargs)`` and return its result.

    Fails when ``name`` is missing, still raises NotImplementedError, raises anything else,
    or takes its answer from mha_lab (``forbid_reference``). A remote submission
    (``mha_lab.grading.remote``) runs the call in the student's process instead of here.
    """
    return invoke(student, name, args, kwargs)[0]


def call_with_peak(student: Mapping[str, Any], name: str, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Like ``call``, and also return the peak bytes the call allocated (tracemalloc)."""
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
    """The one way a check runs student code: returns ``(result, peak bytes or None)``."""
    if hasattr(student, "remote_call"):
        return student.remote_call(name, args, kwargs, measure=measure, replace=dict(replace or {}))
    fn = _lookup(student, name)
    allowed = getattr(student, "allowed", frozenset())
    forbid_reference(student, name, allowed=allowed)
    args, kwargs = copy.deepcopy((args, kwargs))  # the student's code may write into its inputs
    with _Tripwires(fn, allowed) as wires:
        wires.substitute(replace or {})
        try:
            if measure:
                result, peak = _measure(lambda: _run(name, fn, args, kwargs))
            else:
                result, peak = _run(name, fn, args, kwargs), None
        except AssertionError:
            _fail_if_used(name, wires.hits)  # "uses mha_lab..." explains the error better than the tripwire's
            raise
    _fail_if_used(name, wires.hits)
    return result, peak


# --- refusing answers taken from mha_lab -------------------------------------------------------


def _reference_names(allowed: frozenset[str]) -> dict[str, str]:
    """Forbidden public names -> the module that provides them (e.g. 'split_heads' -> 'mha_lab.cpu')."""
    names: dict[str, str] = {}
    for mod_name in REFERENCE_MODULES:
        mod = sys.modules.get(mod_name)
        if mod is None and mod_name != "mha_lab.cuda":  # importing mha_lab.cuda costs seconds (torch)
            mod = importlib.import_module(mod_name)
        if mod is None:
            continue
        for attr in getattr(mod, "__all__", ()):
            if attr not in allowed:
                names.setdefault(attr, mod_name)
    for mod_name, attrs in TORCH_REFERENCES.items():
        for attr in attrs:
            names.setdefault(attr, mod_name)
    return names


def _is_reference_module(obj: Any) -> bool:
    name = getattr(obj, "__name__", "") if isinstance(obj, types.ModuleType) else ""
    return name == "mha_lab" or name.startswith(("mha_lab.", "torch"))


def _owner(obj: Any) -> str:
    """The module an object comes from ('' when it is the student's own)."""
    mod = getattr(obj, "__module__", None)
    if mod is None and not isinstance(obj, type):
        mod = getattr(type(obj), "__module__", "")
    return mod or ""


def _code_objects(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _static_uses(fn: Callable, forbidden: dict[str, str]) -> str | None:
    """Walk ``fn``'s code recursively (nested functions, closures, the student's helpers it calls).

    Returns ``"mha_lab.cpu.<x>"`` for the first reference implementation it reaches, else None.
    """
    seen: set[int] = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        f = getattr(f, "__func__", f)  # bound methods
        code = getattr(f, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        scope = getattr(f, "__globals__", {})
        names = {n for c in _code_objects(code) for n in c.co_names}
        values = [scope[n] for n in names if n in scope]
        values += [c.cell_contents for c in (f.__closure__ or ()) if _cell_filled(c)]
        if any(n.startswith("mha_lab.cuda") for n in names):  # the whole GPU package is a reference
            return "mha_lab.cuda"
        # modules reachable from the body: globals, closures, and imports inside the body
        modules = [v for v in values if _is_reference_module(v)]
        modules += [sys.modules[n] for n in names if n.startswith(("mha_lab", "torch")) and n in sys.modules]
        while modules:
            mod = modules.pop()
            for n in names:
                attr = getattr(mod, n, None)
                if isinstance(attr, types.ModuleType) and attr not in modules:
                    if attr is not mod and _is_reference_module(attr):
                        modules.append(attr)
                elif n in forbidden and callable(attr):
                    return f"{forbidden[n]}.{n}"
        for v in values:
            owner = _owner(v)
            if owner.startswith(REFERENCE_MODULES) and getattr(v, "__name__", "") in forbidden:
                return f"{forbidden[v.__name__]}.{v.__name__}"
            if owner.startswith(REFERENCE_MODULES) and type(v).__name__ in forbidden:  # a layer object
                return f"{forbidden[type(v).__name__]}.{type(v).__name__}"
            if callable(v) and not owner.startswith(("mha_lab", "numpy", "torch", "builtins")):
                stack.append(v)  # the student's own helper: look inside it too
    return None


def _cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises ValueError
    except ValueError:
        return False
    return True


def forbid_reference(student: Mapping[str, Any], name: str, allowed: Iterable[str] = ()) -> None:
    """Fail when the student's ``name`` reaches a reference implementation in its code.

    Looks at the function's names, globals, closures, nested functions, the student's helper
    functions it uses, and imports inside its body. ``call`` also runs the function with the
    references replaced by tripwires, which catches what this static look misses.
    """
    allowed = frozenset(allowed) | getattr(student, "allowed", frozenset())
    fn = _lookup(student, name)
    used = _static_uses(fn, _reference_names(allowed))
    if used:
        raise AssertionError(f"`{name}` uses {used} instead of implementing it: no points for `{name}`")


class _Tripwire:
    """Stands in for a reference implementation during the student's call and records its use."""

    def __init__(self, label: str, original: Callable, wires: _Tripwires) -> None:
        self.label, self.original, self.wires = label, original, wires

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.wires.suspended:  # a reference the check itself substituted is running
            return self.original(*args, **kwargs)
        self.wires.hits.append(self.label)
        raise RuntimeError(f"{self.label} is not available while grading this function")

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # also stands in for a method
        if obj is None or self.wires.suspended:
            return self if obj is None else self.original.__get__(obj, objtype)
        return self


class _Tripwires:
    """Context manager: replace the forbidden references everywhere the student can reach them."""

    def __init__(self, fn: Callable, allowed: frozenset[str]) -> None:
        self.fn, self.allowed = fn, allowed
        self.hits: list[str] = []
        self.suspended = 0
        self.saved: list[tuple[Any, str, Any, bool]] = []

    def substitute(self, replace: Mapping[str, str]) -> None:
        """Put trusted references in place of the student's helpers named in ``replace``."""
        scope = getattr(self.fn, "__globals__", None)
        for attr, dotted in replace.items():
            if scope is None or attr not in scope:
                continue
            module, _, func = dotted.rpartition(".")
            reference = getattr(importlib.import_module(module), func)
            if isinstance(reference, _Tripwire):
                reference = reference.original

            def trusted(*args: Any, _ref: Callable = reference, **kwargs: Any) -> Any:
                self.suspended += 1
                try:
                    return _ref(*args, **kwargs)
                finally:
                    self.suspended -= 1

            self.saved.append((scope, attr, scope[attr], True))
            scope[attr] = trusted

    def _replace(self, holder: Any, attr: str, label: str) -> None:
        is_dict = isinstance(holder, dict)
        old = holder[attr] if is_dict else holder.__dict__.get(attr)
        if old is None or isinstance(old, _Tripwire):
            return
        self.saved.append((holder, attr, old, is_dict))
        wire = _Tripwire(label, old, self)
        if is_dict:
            holder[attr] = wire
        else:
            setattr(holder, attr, wire)

    def __enter__(self) -> _Tripwires:
        forbidden = _reference_names(self.allowed)
        scope = getattr(self.fn, "__globals__", {})
        holders = [m for n, m in list(sys.modules.items()) if m is not None and n.startswith(REFERENCE_MODULES)]
        holders += [v for v in scope.values() if isinstance(v, types.ModuleType)
                    and v.__name__.startswith(REFERENCE_MODULES) and v not in holders]  # stale copies
        for holder in holders:
            for attr in forbidden.keys() & vars(holder).keys():
                self._wire(holder, attr, forbidden[attr])
        for attr, value in list(scope.items()):  # ``from mha_lab.cpu import per_head_attention`` in the notebook
            name = getattr(value, "__name__", None)
            if name in forbidden and _owner(value).startswith(REFERENCE_MODULES):
                self._wire(scope, attr, forbidden[name])
        torch_f = sys.modules.get("torch.nn.functional")
        if torch_f is not None:
            for attr in TORCH_REFERENCES["torch.nn.functional"]:
                self._replace(torch_f, attr, f"torch.nn.functional.{attr}")
        return self

    def _wire(self, holder: Any, attr: str, module_label: str) -> None:
        value = holder[attr] if isinstance(holder, dict) else getattr(holder, attr)
        if not callable(value):
            return
        label = f"{module_label}.{getattr(value, '__name__', attr)}"
        if isinstance(value, type):  # a layer class: its methods compute the answer
            for klass in value.__mro__[:-1]:
                for method in _METHODS:
                    if method in klass.__dict__:
                        self._replace(klass, method, label)
            return
        self._replace(holder, attr, label)

    def __exit__(self, *exc: object) -> None:
        for holder, attr, old, is_dict in reversed(self.saved):
            if is_dict:
                holder[attr] = old
            else:
                setattr(holder, attr, old)


def _fail_if_used(name: str, hits: list[str]) -> None:
    if hits:
        raise AssertionError(f"`{name}` uses {hits[0]} instead of implementing it: no points for `{name}`")


# --- judging -------------------------------------------------------------------------------------


def expect_array(value: Any, *, what: str, shape: tuple[int, ...], dtype: Any = np.float64,
                 hint: str = "overflow in exp (softmax without subtracting the max?) or a wrong mask") -> np.ndarray:
    """Type, shape, dtype and finiteness, in that order, each failure naming ``what``.

    ``hint`` is the likely bug when entries are NaN or inf.
    """
    if type(value) is not np.ndarray:
        raise AssertionError(f"{what}: expected a numpy.ndarray, got {type(value).__name__}")
    if value.shape != tuple(shape):
        raise AssertionError(f"{what}: expected shape {tuple(shape)}, got {value.shape}")
    if dtype is not None and value.dtype != np.dtype(dtype):
        raise AssertionError(f"{what}: expected dtype {np.dtype(dtype)}, got {value.dtype}")
    if not np.isfinite(value).all():
        bad = int(np.size(value) - np.isfinite(value).sum())
        raise AssertionError(f"{what}: {bad} entries are NaN or inf. Likely bug: {hint}")
    return value


def expect_close(actual: np.ndarray, expected: np.ndarray, *, what: str, hint: str) -> None:
    """Values within ``mha_lab.testing.tolerances`` of the reference; else name the likely bug."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: expected shape {expected.shape}, got {actual.shape}")
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


# --- memory ----------------------------------------------------------------------------------------


def _measure(thunk: Callable[[], Any]) -> tuple[Any, int]:
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        result = thunk()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return result, max(int(peak), 0)


def peak_bytes(fn: Callable, *args: Any, **kwargs: Any) -> int:
    """Peak bytes allocated while ``fn(*args, **kwargs)`` runs (tracemalloc sees NumPy buffers)."""
    return _measure(lambda: fn(*args, **kwargs))[1]


def expect_within_budget(peak: int, budget: int, *, what: str, hint: str) -> None:
    """Peak memory at most ``budget`` bytes, e.g. less than one full (B, h, L, L) score matrix."""
    if peak > budget:
        raise AssertionError(
            f"{what}: peak memory {peak / 2**20:.2f} MiB is over the budget of {budget / 2**20:.2f} MiB. "
            f"Likely bug: {hint}"
        )


class SmoothLoss:
    """A scalar test function of the array it holds: f() = sum(sin(x) x^2), exact gradient cos(x) x^2 + 2 x sin(x).

    An object, not a closure, so that it can cross to a trusted-mode worker together with the very
    ``x`` a student's finite-difference code perturbs (the value codec keeps the two the same array).
    """

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def __call__(self) -> float:
        return float(np.sum(np.sin(self.x) * self.x**2))

    def exact(self) -> np.ndarray:
        return np.cos(self.x) * self.x**2 + 2 * self.x * np.sin(self.x)
