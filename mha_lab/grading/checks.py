"""The helpers every hidden check is written with, in three steps, so that the call runs in the sandbox and
the judging in the grader: (1) make seeded inputs on shapes the visible tests do not use; (2) ``out =
call(student, "name", *args)``; (3) judge with ``expect_array`` / ``expect_close`` / ``expect_true`` /
``expect_within_budget``. Every failure is an ``AssertionError`` naming the property and the likely bug, and
ending with the bug's stable id, ``[bug: <id>]`` (``BUG_TAG``; every hint of a hidden check ends with one): the
class report groups failures by these ids, so rewording a hint never splits or merges its group.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from mha_lab.grading import worker
from mha_lab.grading.references import Extent, Reference
from mha_lab.grading.sandbox import NOT_MEASURED
from mha_lab.measure import traced_memory
from mha_lab.testing import tolerances

__all__ = ["BUG_TAG", "MESSAGE_CHARS", "bug_ids", "clip", "fresh_inputs", "call", "call_with_peak", "call_replacing",
           "invoke", "expect_array", "expect_close", "expect_true", "expect_within_budget", "recording_memory", "retag",
           "SmoothLoss"]


BUG_TAG = re.compile(r"\[bug: ([a-z0-9]+(?:-[a-z0-9]+)*)\]")  # a likely bug's stable id, e.g. [bug: scale-d-model]
MESSAGE_CHARS = 4000  # of a failure message: it may quote the student's own exception, of any length
TAIL_CHARS = 200  # kept from the end of a longer one, where its bug tag is


def clip(message: str) -> str:
    """``message`` cut to about ``MESSAGE_CHARS``, its head and its tail (where the tag is): what any expression
    reads, so that no student's text costs the grader more than a fixed amount of work."""
    if len(message) <= MESSAGE_CHARS:
        return message
    cut = len(message) - MESSAGE_CHARS + TAIL_CHARS
    return f"{message[:MESSAGE_CHARS - TAIL_CHARS]} [... {cut} characters cut ...] {message[-TAIL_CHARS:]}"


def bug_ids(message: str) -> list[str]:
    """The bug ids a failure message names, in order ([] when it names none)."""
    return BUG_TAG.findall(clip(message))


def retag(hint: str, bug: str | None = None, *, note: str = "") -> str:
    """``hint`` without its tags, then ``note``, then ``[bug: bug]`` (the hint's last tag when None, if any):
    ``retag("a [bug: x]", "y", note="; b") == "a; b [bug: y]"``. The tags are cut out by position: an
    expression that also matched the spaces before them would backtrack over a long run of spaces."""
    hint = clip(hint)
    ids = [bug] if bug else bug_ids(hint)[-1:]
    kept, start = [], 0
    for tag in BUG_TAG.finditer(hint):
        kept.append(hint[start:tag.start()].rstrip())
        start = tag.end()
    return "".join([*kept, hint[start:]]).rstrip() + note + "".join(f" [bug: {i}]" for i in ids)


class SmoothLoss(worker.SmoothLoss):
    """The hidden checks' ``worker.SmoothLoss``, with the exact gradient they judge against: this class stays in
    the grader; the sandbox receives the worker's, which holds ``x`` and nothing else."""

    def exact(self) -> np.ndarray:
        """cos(x) x^2 + 2 x sin(x)."""
        return np.cos(self.x) * self.x**2 + 2 * self.x * np.sin(self.x)


def fresh_inputs() -> Callable[[int], np.random.Generator]:
    """A hidden checks module's random inputs: ``_rng = fresh_inputs()`` as the module loads (once per graded
    submission), then ``_rng(key)`` for check ``key``: the same numbers within one load, new ones in every
    grading run, so that an output seen in one run's feedback is of no use in the next."""
    entropy = np.random.SeedSequence().entropy
    return lambda key: np.random.default_rng([key, entropy])


def call(student: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Step 2 of a check: the student's ``name(*args, **kwargs)``; fails when it is missing or raises."""
    return invoke(student, name, args, kwargs)[0]


def call_with_peak(student: Any, name: str, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Like ``call``, with the peak bytes the call allocated (``remote.RemoteSubmission.remote_call``)."""
    return invoke(student, name, args, kwargs, measure=True)


def call_replacing(student: Any, replace: Mapping[str, Reference], name: str,
                   *args: Any, **kwargs: Any) -> Any:
    """Like ``call``, with helpers swapped for references during the call: ``replace`` maps a notebook name to a
    declared reference (``{"rope": Reference("mha_lab.cpu.apply_rope", ...)}``, ``references``), so that a loop is
    judged on its own. In a sandbox the reference runs in the grader, called back over the pipe, on arguments its
    declaration accepts only."""
    return invoke(student, name, args, kwargs, replace=replace)[0]


def invoke(student: Any, name: str, args: tuple, kwargs: dict, *, measure: bool = False,
           replace: Mapping[str, Reference] | None = None) -> tuple[Any, int | None]:
    """The one way a check runs student code, in its sandbox or (a kernel's namespace) here: ``(result, peak)``.
    When the student's function raises, the message adds what it was given (arrays by shape and dtype)."""
    try:
        return _invoke(student, name, args, kwargs, measure=measure, replace=dict(replace or {}))
    except AssertionError as exc:
        if f"`{name}` raised " not in str(exc):
            raise
        given = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
        raise AssertionError(retag(str(exc), note=f" (called with {', '.join(given) or 'no arguments'})")) from None


def _invoke(student: Any, name: str, args: tuple, kwargs: dict, *, measure: bool,
            replace: dict[str, Reference]) -> tuple[Any, int | None]:
    if not all(isinstance(r, Reference) for r in replace.values()):
        raise TypeError("a reference handed to student code must be declared (references.Reference)")
    if hasattr(student, "remote_call"):
        return student.remote_call(name, args, kwargs, measure=measure, replace=replace)
    args, kwargs = copy.deepcopy((args, kwargs))  # the student's code may write into its inputs
    arrays: list[np.ndarray] = []
    worker.encode((args, kwargs), arrays)
    references = {attr: r.bound(Extent.of(arrays)) for attr, r in replace.items()}
    if not measure:
        return worker.call(student, name, args, kwargs, references), None
    result: list[Any] = []
    peak = traced_memory(lambda: result.append(worker.call(student, name, args, kwargs, references)))[1]
    return result[0], peak


def _describe(value: Any) -> str:
    """An input as the feedback shows it: an array by shape and dtype, a short value by its repr."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"array {tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


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
        raise AssertionError(f"{what}: values differ from the reference (max abs error {float(err.max()):.3g}). "
                             f"Likely bug: {hint}")


def expect_true(condition: bool, *, what: str, hint: str) -> None:
    """A property that is not a comparison of arrays (e.g. 'returns a list of h matrices')."""
    if not condition:
        raise AssertionError(f"{what}. Likely bug: {hint}")


_READINGS: ContextVar[list | None] = ContextVar("mha_lab_memory_readings", default=None)


@contextmanager
def recording_memory() -> Iterator[list[tuple[int | None, int]]]:
    """``with recording_memory() as readings:``: every ``expect_within_budget`` judged in the block, passed or not,
    adds its ``(peak, budget)`` in bytes, so that the grader's reading goes on record beside the points."""
    readings: list[tuple[int | None, int]] = []
    token = _READINGS.set(readings)
    try:
        yield readings
    finally:
        _READINGS.reset(token)


def expect_within_budget(peak: int | None, budget: int, *, what: str, hint: str) -> None:
    """Peak memory at most ``budget`` bytes, e.g. less than one full (B, h, L, L) score matrix; a peak of None
    (a host that measures no memory: ``sandbox.memory_mode``) earns nothing, and says the instructor grades it.
    The reading is recorded where ``recording_memory`` asks for it."""
    if (readings := _READINGS.get()) is not None:
        readings.append((peak, budget))
    if peak is None:
        raise AssertionError(f"{what}: {NOT_MEASURED}, so the grader gives no points here: the instructor grades "
                             "this cell by hand [bug: memory-not-measured]")
    if peak > budget:
        raise AssertionError(f"{what}: peak memory {peak / 2**20:.2f} MiB is over the budget of "
                             f"{budget / 2**20:.2f} MiB. Likely bug: {hint}")
