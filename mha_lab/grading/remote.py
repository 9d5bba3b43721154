"""The grader's side of the worker: a submission whose code runs in a sandbox, called from the hidden checks."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mha_lab.grading import sandbox
from mha_lab.grading.checks import clip
from mha_lab.grading.references import Extent, Reference, RefusedError
from mha_lab.grading.worker import decode, encode, frame, read_message

__all__ = ["RemoteSubmission", "REPLY_TEXT", "REPLY_VALUES"]

REPLY_TEXT = 16 * 2**20  # bytes of an answer's JSON line (its arrays travel beside it, in .npy format)
REPLY_VALUES = 200_000  # lists, objects and items in an answer's JSON line, checked before it is parsed


class RemoteSubmission:
    """The ``student`` of the hidden checks: calls run in its sandbox, results are judged here, all before one
    deadline; ``stopped`` says why the worker is gone, once it is."""

    def __init__(self, folder: Path, limits: sandbox.Limits) -> None:
        self.folder, self.limits, self.stopped, self.references, self.extent = Path(folder), limits, "", {}, Extent()
        self.deadline, self.definitions = time.monotonic() + limits.seconds, None
        self.copy = sandbox.private_copy(folder, limits)
        self.mode = sandbox.memory_mode(limits)
        self.memory = str(self.mode)  # how its memory is measured, for the grade sheet
        self.proc, self.group = sandbox.start(self.copy, limits, self.mode)
        self.timer = threading.Timer(limits.seconds, self._kill,
                                     [f"the submission ran out of its {limits.seconds:.0f} s"])
        self.timer.daemon = True  # the grader may exit while it waits
        self.timer.start()

    def run(self, cells: Sequence[str], definitions: tuple[Sequence[str], Sequence[str]] | None = None, *,
            files: bool = True) -> list:
        """Run the code cells, the submission's files copied in first (``files``): (printed text, error) each.
        ``definitions`` (default: none, then all), for measured calls: the release's given cells before its
        first answer cell, then the student's cells and those that define the student's functions."""
        self.definitions = definitions or ((), cells)
        return self.request({"op": "run", "cells": list(cells), "files": files})[0].get("outputs", [])

    def request(self, message: dict, arrays: Sequence[np.ndarray] = ()) -> tuple[dict, list[np.ndarray]]:
        """Send a request, answer its ``reference`` requests, return its answer; AssertionError when the worker
        dies, hangs, floods or answers garbage."""
        answer = None
        try:
            if not self.stopped:
                self.proc.stdin.writelines(frame(message, arrays))
                self.proc.stdin.flush()
                answer = self._read()
                while answer is not None and answer[0].get("op") == "reference":
                    self.proc.stdin.writelines(frame(*self._reference(*answer)))
                    self.proc.stdin.flush()
                    answer = self._read()
        except OSError:  # a broken pipe: the worker is gone
            pass
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
            self._kill(f"the submission's worker answered garbage ({type(exc).__name__}: {str(exc)[:200]})")
        if answer is None:  # the deadline's kill, or the worker's own end
            self._kill(f"the submission's process stopped (exit code {self.proc.wait()}): did its code call "
                       "os._exit or crash?")
            raise AssertionError(self.stopped)
        return answer

    def _read(self) -> tuple[dict, list[np.ndarray]] | None:
        """The worker's next message, bounded in size and structure before it is parsed; None once it is gone or
        past the deadline (which the grader's own work in between counts towards)."""
        if time.monotonic() > self.deadline:
            self._kill(f"the submission ran out of its {self.limits.seconds:.0f} s")
            return None
        return read_message(self.proc.stdout, self.limits.output, text=REPLY_TEXT, values=REPLY_VALUES)

    def _reference(self, message: dict, arrays: list[np.ndarray]) -> tuple[dict, list[np.ndarray]]:
        """Run the reference asked for if the call in progress named it, on arguments its declaration accepts
        (``references.Reference.bind``: near the sizes of the call, ``Extent``); the reply carries the arguments'
        arrays as it left them (it may change them in place), then its result."""
        arrays = [np.array(a) for a in arrays]  # writable copies
        name = str(message.get("name"))[:40]
        reference = self.references.get(name)
        if reference is None:
            return {"ok": False, "message": f"`{name}` is answered by the grader only during the call it was given "
                                            "to"}, arrays
        try:
            args, kwargs = decode(message["arguments"], arrays, lambda i: self._student_callable(i, arrays))
            if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
                raise RefusedError("arguments that are not a list and a dict of keywords")
            result, sent = reference.call(args, kwargs, self.extent), list(arrays)
            return {"ok": True, "result": encode(result, sent)}, sent  # the arguments' arrays first
        except AssertionError:
            raise
        except RefusedError as exc:
            return {"ok": False, "message": f"the grader's `{name}` refused its arguments: {exc}"}, arrays
        except Exception as exc:  # noqa: BLE001 - e.g. arguments of the wrong shape from the student's code
            return {"ok": False, "message": f"{name} raised {type(exc).__name__}: {exc}"}, arrays

    def _student_callable(self, index: int, shared: list[np.ndarray]) -> Callable:
        """The worker's callable ``index``: each call sends the shared arrays first, as they are now."""

        def invoke(*args: Any, **kwargs: Any) -> Any:
            sent = list(shared)  # first, as the reference has left them
            reply, results = self.request({"op": "invoke", "object": index, "arguments": encode((args, kwargs), sent)},
                                          sent)
            if not reply.get("ok"):
                raise RuntimeError(f"the student's function failed: {reply.get('message')}")
            return decode(reply.get("result"), results)

        return invoke

    def remote_call(self, name: str, args: tuple, kwargs: dict, *, measure: bool,
                    replace: dict[str, Reference]) -> tuple[Any, int | None]:
        """``(result, peak bytes or None)`` of ``name`` in the sandbox, the helpers in ``replace`` (name -> declared
        reference) answered here by their references. A measured call is the first call of a fresh sandbox: the
        release's given cells run, then the memory baseline (``sandbox.MemoryGroup.baseline``), then, counted as
        the student's, the submission's files and the student's cells up to its last answer. The peak, read from
        the memory cgroup outside the sandbox, counts from just before the call, less the inputs: what the
        student's code keeps or allocates counts, nothing of the worker's or the tests' does. None where this
        host measures no memory (``sandbox.memory_mode``): the call is not measured at all."""
        self.references = dict(replace)
        try:
            if not measure or self.mode.parent is None:
                return self._call(name, (args, kwargs))[0], None
            limits = dataclasses.replace(self.limits, seconds=max(self.deadline - time.monotonic(), 1.0))
            with contextlib.closing(RemoteSubmission(self.folder, limits)) as fresh:
                fresh.run(self.definitions[0], files=False)
                group = fresh.group
                try:
                    if group is None:
                        raise OSError("the kernel refused one")
                    group.baseline()
                except OSError as exc:
                    self.memory, group = f"{sandbox.NOT_MEASURED} (no memory cgroup for a sandbox: {exc})", None
                fresh.run(self.definitions[1])
                if group is not None:
                    group.reset()
                fresh.references = self.references
                result, inputs = fresh._call(name, (args, kwargs))
                peak = None if group is None else max(group.peak() - inputs, 0)  # the cgroup counts the inputs
            return result, peak
        finally:
            self.references = {}

    def _call(self, name: str, arguments: tuple) -> tuple[Any, int]:
        """One call: its result and the bytes of its inputs."""
        arrays: list[np.ndarray] = []
        message = {"op": "call", "name": name, "arguments": encode(arguments, arrays),
                   "replace": sorted(self.references)}
        self.extent = Extent.of(arrays)
        reply, results = self.request(message, arrays)
        if not reply.get("ok"):
            raise AssertionError(clip(str(reply.get("message", "the call failed"))))
        return decode(reply.get("result"), results), sum(a.nbytes for a in arrays)

    def _kill(self, reason: str) -> None:
        """Stop the worker, recording why (the first reason stands): killing bwrap's child ends its pid namespace;
        unconfined, the worker's process group goes."""
        self.stopped, pid = self.stopped or reason, self.proc.pid
        with contextlib.suppress(OSError):  # it has gone already
            if self.limits.unsafe:
                os.killpg(pid, signal.SIGKILL)
            for victim in Path(f"/proc/{pid}/task/{pid}/children").read_text().split() or [pid]:
                os.kill(int(victim), signal.SIGKILL)

    def close(self) -> None:
        """Stop the worker and wait for it: no process of the submission outlives this call."""
        self.timer.cancel()
        self._kill("")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        if self.group is not None:
            self.group.release()
        shutil.rmtree(self.copy, ignore_errors=True)
