"""The grader's references that a student's code may call during a check, each behind a declared signature.

A check may hand the student's function a reference in place of one of its helpers (``checks.call_replacing``:
``rope`` for ``paged_decode_step``, say), so that a bug in one task costs its points only once. The reference
then runs in the grader, on arguments the student's code chose. Each one is declared as a ``Reference``: its
dotted path and, for every parameter, what it accepts (``Array``, ``Number``, ``Choice``, ``Function``). Before any
computation, ``Reference.bind`` refuses, with a message naming the parameter, any argument that is not declared:
an unknown keyword, a wrong type, a list where a number goes, an array of the wrong kind or number of axes, or
larger than ``Extent`` allows near the sizes of the call in progress. This module is the one wrapper every
assignment's references go through, in the sandbox's grader (``remote``) and in a kernel's namespace alike.
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Extent", "Array", "Number", "Choice", "Function", "Reference", "RefusedError"]

GROWTH, REACH = 16, 4  # how much larger than the call's own arrays a reference's may be (elements, longest axis)
FLOOR_ELEMENTS, FLOOR_AXIS = 1 << 16, 64  # ... and always this large: a reference costs at most milliseconds


class RefusedError(ValueError):
    """Arguments a reference does not accept; the message names the parameter and what it takes."""


@dataclasses.dataclass(frozen=True)
class Extent:
    """The sizes of the call in progress. A reference computes on arrays of about those sizes (at most ``GROWTH``
    times the elements and ``REACH`` times the longest axis, or ``FLOOR_ELEMENTS`` and ``FLOOR_AXIS``, with at most
    one axis more), so that whatever the student's code asks for costs a small multiple of what the check's call
    does, while it may still call the reference on what it built from its inputs (all the cached keys, say)."""

    elements: int = 0
    axis: int = 0
    ndim: int = 0

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> Extent:
        return cls(max((a.size for a in arrays), default=0), max((max(a.shape, default=1) for a in arrays), default=0),
                   max((a.ndim for a in arrays), default=0))

    def bounds(self) -> tuple[int, int, int]:
        """The most elements, the longest axis and the most axes of an array a reference computes on."""
        return max(GROWTH * self.elements, FLOOR_ELEMENTS), max(REACH * self.axis, FLOOR_AXIS), self.ndim + 1

    def check(self, name: str, array: np.ndarray) -> None:
        elements, axis, ndim = self.bounds()
        if array.size > elements or max(array.shape, default=1) > axis or array.ndim > ndim:
            raise RefusedError(f"`{name}` is taken only near the sizes of the call it was given to (arrays of at most "
                          f"{elements} elements and {ndim} axes, each of at most {axis}); got shape {array.shape}")


@dataclasses.dataclass(frozen=True)
class Array:
    """A NumPy array of a dtype kind in ``kinds`` ("f" float, "i" signed, "u" unsigned integer, "b" bool) with
    ``ndim[0]`` to ``ndim[1]`` axes; ``listed``: a flat list or tuple of numbers is taken too, as an array;
    ``optional``: None is taken."""

    ndim: tuple[int, int]
    kinds: str = "f"
    listed: bool = False
    optional: bool = False

    def accept(self, name: str, value: Any, extent: Extent) -> Any:
        if value is None and self.optional:
            return None
        if self.listed and isinstance(value, list | tuple):
            most = extent.bounds()[1]
            if len(value) > most:
                raise RefusedError(f"`{name}`: a list of at most {most} numbers, got {len(value)} items")
            if not all(isinstance(v, numbers.Real) for v in value):
                raise RefusedError(f"`{name}`: a flat list of numbers, got an item of type "
                              f"{next(type(v).__name__ for v in value if not isinstance(v, numbers.Real))}")
            value = np.asarray(value)
        if type(value) is not np.ndarray:
            raise RefusedError(f"`{name}`: a numpy.ndarray, got {type(value).__name__}")
        if value.dtype.kind not in self.kinds:
            raise RefusedError(f"`{name}`: an array of kind {'/'.join(self.kinds)}, got dtype {value.dtype}")
        if not self.ndim[0] <= value.ndim <= self.ndim[1]:
            raise RefusedError(f"`{name}`: an array of {self.ndim[0]} to {self.ndim[1]} axes, got shape {value.shape}")
        extent.check(name, value)
        return value


@dataclasses.dataclass(frozen=True)
class Number:
    """A real number (a NumPy scalar too, never a bool) from ``low`` to ``high``; ``integer``: a whole one."""

    low: float
    high: float
    integer: bool = False

    def accept(self, name: str, value: Any, extent: Extent) -> Any:
        if isinstance(value, np.generic) and value.ndim == 0:
            value = value.item()
        kind = numbers.Integral if self.integer else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            raise RefusedError(f"`{name}`: {'an integer' if self.integer else 'a number'}, got {type(value).__name__}")
        if not self.low <= value <= self.high:
            raise RefusedError(f"`{name}`: from {self.low:g} to {self.high:g}, got {value!r:.40}")
        return value


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``values`` (strings, booleans or None)."""

    values: tuple[Any, ...]

    def accept(self, name: str, value: Any, extent: Extent) -> Any:
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise RefusedError(f"`{name}`: one of {', '.join(map(repr, self.values))}, got {value!r:.40}")
        return value


@dataclasses.dataclass(frozen=True)
class Function:
    """A callable: one of the student's functions, which runs in the student's sandbox when called."""

    def accept(self, name: str, value: Any, extent: Extent) -> Any:
        if not callable(value) or isinstance(value, type):
            raise RefusedError(f"`{name}`: a function, got {type(value).__name__}")
        return value


Spec = Array | Number | Choice | Function


@dataclasses.dataclass(frozen=True)
class Reference:
    """A function of the package (``path``, dotted) and what each of its parameters accepts (``params``, in
    positional order); the first ``required`` must be given, the others keep their defaults when left out."""

    path: str
    params: tuple[tuple[str, Spec], ...]
    required: int

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any], extent: Extent) -> dict[str, Any]:
        """The arguments by name, each accepted by its declaration; ``RefusedError`` for anything else."""
        names = [n for n, _ in self.params]
        if len(args) > len(names):
            raise RefusedError(f"at most {len(names)} arguments ({', '.join(names)}), got {len(args)}")
        unknown = [str(k)[:40] for k in kwargs if k not in names]
        if unknown:
            raise RefusedError(f"no parameter {unknown[0]!r}: it takes {', '.join(names)}")
        given = dict(zip(names, args, strict=False))
        twice = [k for k in kwargs if k in given]
        if twice:
            raise RefusedError(f"`{twice[0]}` given twice")
        given.update(kwargs)
        missing = [n for n in names[:self.required] if n not in given]
        if missing:
            raise RefusedError(f"missing argument `{missing[0]}`")
        specs = dict(self.params)
        return {n: specs[n].accept(n, v, extent) for n, v in given.items()}

    def function(self) -> Callable:
        module, _, name = self.path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def call(self, args: Sequence[Any], kwargs: Mapping[str, Any], extent: Extent) -> Any:
        """The reference on the arguments, once ``bind`` has accepted them (by position up to the first one left
        out, by name after it)."""
        named, positional = self.bind(args, kwargs, extent), []
        for name, _ in self.params:
            if name not in named:
                break
            positional.append(named.pop(name))
        return self.function()(*positional, **named)

    def bound(self, extent: Extent) -> Callable:
        """The reference as a function, for student code that runs in this process (a kernel's namespace)."""
        name = self.path.rpartition(".")[2]

        def reference(*args: Any, **kwargs: Any) -> Any:
            try:
                return self.call(args, kwargs, extent)
            except RefusedError as exc:
                raise ValueError(f"the grader's {name} refused its arguments: {exc}") from None

        reference.__name__ = name
        return reference
