"""The worker protocol: the student's code runs in the sandbox, the grader asks it for calls.

Each request and each answer is one JSON line, followed by the arrays it carries in NumPy's
``.npy`` format (``frame``), over the sandbox's stdin and stdout. ``run`` executes the notebook's
code cells (their printed output and errors come back for the feedback); ``call`` runs one of the
student's functions. Nothing crosses as a pickle, so nothing the sandbox sends can run code in the
grader; arrays are read into place, not copied, so a call's memory is the call's own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np

from mha_lab.grading import checks, sandbox

__all__ = ["encode", "decode", "frame", "read_message", "RemoteSubmission", "serve"]

# NumPy functions that may cross by name: pure reductions and ufuncs, nothing that touches files.
NUMPY_FUNCTIONS = frozenset({"sum", "mean", "std", "var", "max", "min", "prod", "median"})
CELL_SECONDS = 60  # one notebook cell, as nbgrader's Execute.timeout was
OUTPUT_CHARS = 20_000  # printed output kept per cell
RNG = np.random.default_rng()  # the decoy inputs of measured calls
NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _numpy_function(name: Any) -> Any:
    """``np.<name>`` when it is a ufunc or one of ``NUMPY_FUNCTIONS``, else None."""
    fn = getattr(np, name, None) if isinstance(name, str) else None
    return fn if isinstance(fn, np.ufunc) or name in NUMPY_FUNCTIONS else None


def encode(value: Any, arrays: list[np.ndarray]) -> Any:
    """A JSON-ready form of numbers, strings, None, lists, tuples, dicts, NumPy scalars and functions and
    ``checks.SmoothLoss``; arrays go into ``arrays`` (they travel after the JSON, see ``frame``).

    An array met twice in one value (``(f, x)`` where f holds x) travels once, so the receiver sees one
    array, as the sender did.
    """
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.hasobject:
            raise ValueError("arrays of Python objects cannot be sent without pickles")
        if not any(a is value for a in arrays):
            arrays.append(value)
        index = next(i for i, a in enumerate(arrays) if a is value)
        return {"__ndarray__" if isinstance(value, np.ndarray) else "__npscalar__": index}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, arrays) for v in value]}
    if isinstance(value, list):
        return [encode(v, arrays) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, arrays), encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, checks.SmoothLoss):
        return {"__smooth_loss__": encode(value.x, arrays)}
    if _numpy_function(getattr(value, "__name__", "")) is value:
        return {"__numpy__": value.__name__}  # by name: the receiver looks it up in its own NumPy
    return {"__unsupported__": type(value).__name__}


def decode(value: Any, arrays: Sequence[np.ndarray]) -> Any:
    """The inverse of ``encode``; an unsupported type comes back as a placeholder string."""
    if isinstance(value, list):
        return [decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "__ndarray__" in value:
        return arrays[value["__ndarray__"]]
    if "__npscalar__" in value:
        return arrays[value["__npscalar__"]][()]
    if "__tuple__" in value:
        return tuple(decode(v, arrays) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k, arrays): decode(v, arrays) for k, v in value["__dict__"]}
    if "__smooth_loss__" in value:
        return checks.SmoothLoss(decode(value["__smooth_loss__"], arrays))
    if "__numpy__" in value and _numpy_function(value["__numpy__"]) is not None:
        return _numpy_function(value["__numpy__"])
    return f"<unsupported value of type {value.get('__unsupported__', '?')}>"


def frame(message: dict, arrays: Sequence[np.ndarray]) -> list[bytes | memoryview]:
    """One message as it travels: a JSON line that gives the size of each array, then the arrays in
    NumPy's ``.npy`` format, each padded to 64 bytes. The arrays' data is not copied (when contiguous)."""
    parts, sizes = [], []
    for a in arrays:
        a = np.array(a, order="C", copy=None)  # 0-d stays 0-d
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, np.lib.format.header_data_from_array_1_0(a))
        parts += [head.getvalue(), memoryview(a.reshape(-1).view(np.uint8)), bytes(-a.nbytes % 64)]
        sizes.append(head.tell() + a.nbytes + len(parts[-1]))
    return [(json.dumps({**message, "sizes": sizes}) + "\n").encode(), *parts]


def read_message(stream: io.BufferedIOBase, limit: int = 1 << 62) -> tuple[dict, list[np.ndarray]] | None:
    """The next message on ``stream`` (see ``frame``), or None where the stream ends. Its arrays are views of one
    buffer, read into place; ValueError for anything malformed, longer than ``limit`` bytes or pickled."""
    line = stream.readline(limit)
    if not line:
        return None
    message, arrays, start = json.loads(line), [], 0
    sizes = [int(n) for n in message.get("sizes", [])]
    if not line.endswith(b"\n") or len(line) + sum(sizes) > limit:
        raise ValueError(f"a message longer than {limit} bytes")
    payload = bytearray(sum(sizes))
    view, done = memoryview(payload), 0
    while done < len(payload) and (n := stream.readinto(view[done:])):
        done += n
    if done < len(payload):  # the stream ended inside the message
        return None
    for size in sizes:
        head = io.BytesIO(payload[start:start + min(size, 1 << 16)])
        read = NPY_HEADERS.get(np.lib.format.read_magic(head))
        if read is None:
            raise ValueError("an array in a .npy version this reader does not know")
        shape, fortran, dtype = read(head)
        count = int(np.prod(shape))
        if dtype.hasobject or head.tell() + count * dtype.itemsize > size:
            raise ValueError("an array that does not fit its size, or that needs pickles")
        array = np.frombuffer(payload, dtype, count, offset=start + head.tell())
        arrays.append(array.reshape(shape, order="F" if fortran else "C"))
        start += size
    return message, arrays


# --- the student's side, in the sandbox ----------------------------------------------------------


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the cell ran longer than {CELL_SECONDS} s")


class _Capped(io.StringIO):
    """Printed output that keeps its first ``OUTPUT_CHARS`` characters and drops the rest."""

    def write(self, text: str) -> int:
        return super().write(str(text)[:max(OUTPUT_CHARS - self.tell(), 0)]) if self.tell() < OUTPUT_CHARS else 0


def _run_cell(source: str, namespace: dict) -> tuple[str, str]:
    """Execute one cell: what it printed, and its error as ``"Name: message"`` ('' when none)."""
    out, error = _Capped(), ""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CELL_SECONDS)
    try:
        with redirect_stdout(out), redirect_stderr(out):
            exec(compile(source, "<cell>", "exec"), namespace)  # noqa: S102 - the student's code, sandboxed
    except BaseException as exc:  # noqa: BLE001 - a broken cell is the student's problem: go on
        error = f"{type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
    return out.getvalue(), error


def serve() -> None:
    """The worker's main: enter the sandbox, then answer requests on stdin until it closes."""
    sandbox.enter(int(sys.argv[1]))
    channel, requests = os.fdopen(os.dup(1), "wb"), sys.stdin.buffer
    os.dup2(2, 1)  # the student's prints go to stderr (discarded), never into the channel
    sys.stdout, sys.stdin = sys.stderr, open(os.devnull)  # noqa: SIM115 - for the process's lifetime
    namespace: dict[str, Any] = {"__name__": "__main__"}
    while (received := read_message(requests)) is not None:
        channel.writelines(frame(*_answer(*received, namespace)))
        channel.flush()
        del received  # before the next request arrives: a measured call starts with nothing of the last one


def _answer(request: dict, arrays: list[np.ndarray], namespace: dict) -> tuple[dict, list[np.ndarray]]:
    """The reply to one request and the arrays that go with it."""
    if request["op"] == "run":
        return {"ok": True, "outputs": [_run_cell(source, namespace) for source in request["cells"]],
                "names": sorted(k for k in namespace if not k.startswith("_"))}, []
    sent: list[np.ndarray] = []
    try:
        args, kwargs = decode(request["arguments"], arrays)
        result, peak = checks.run(namespace, request["name"], args, kwargs, measure=request["measure"],
                                  replace=request["replace"])
        return {"ok": True, "result": encode(result, sent), "peak": peak}, sent
    except AssertionError as exc:
        return {"ok": False, "message": str(exc)}, []
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot cross without pickles
        return {"ok": False, "message": f"`{request['name']}` returned a value that cannot be sent: {exc}"}, []


# --- the grader's side ----------------------------------------------------------------------------


class RemoteSubmission(dict):
    """The ``student`` of the hidden checks, its code in a sandbox: the names its notebook defined
    (placeholders: the objects stay in the sandbox) and its cells, for ``checks.reference_use``. Calls run
    in the sandbox, results are judged here. Every request shares one deadline; ``stopped`` says why the
    worker is gone, once it is."""

    def __init__(self, folder: Path, limits: sandbox.Limits, allowed: Sequence[str] = ()) -> None:
        super().__init__()
        self.limits, self.allowed, self.cells, self.stopped = limits, frozenset(allowed), (), ""
        self.copy = sandbox.private_copy(folder, limits)
        self.proc, self.group = sandbox.start([sandbox.PYTHON, "-m", "mha_lab.grading.worker", str(limits.processes)],
                                              self.copy, limits)
        self.timer = threading.Timer(limits.seconds, self._kill,
                                     [f"the submission ran out of its {limits.seconds:.0f} s"])
        self.timer.daemon = True  # the grader may exit while it waits
        self.timer.start()

    def run(self, cells: Sequence[str]) -> list:
        """Execute the notebook's code cells; for each, what it printed and its error (see ``_run_cell``)."""
        self.cells = tuple(cells)
        reply, _ = self.request({"op": "run", "cells": list(cells)})
        self.update({n: f"<{n} in the submission's sandbox>" for n in reply.get("names", []) if isinstance(n, str)})
        return reply.get("outputs", [])

    def request(self, message: dict, arrays: Sequence[np.ndarray] = ()) -> tuple[dict, list[np.ndarray]]:
        """Send one request, wait for its answer and its arrays; AssertionError when the worker dies, hangs,
        floods or answers garbage."""
        answer = None
        try:
            if not self.stopped:
                self.proc.stdin.writelines(frame(message, arrays))
                self.proc.stdin.flush()
                answer = read_message(self.proc.stdout, self.limits.output)
        except OSError:  # a broken pipe: the worker is gone
            pass
        except (ValueError, TypeError, AttributeError):
            self._kill(f"the submission's worker answered garbage, or more than {self.limits.output} bytes")
        if answer is None:  # the deadline's kill, or the worker's own end
            self._kill(f"the submission's process stopped (exit code {self.proc.wait()}): did its code call "
                       "os._exit or crash?")
            raise AssertionError(self.stopped)
        return answer

    def remote_call(self, name: str, args: tuple, kwargs: dict, *, measure: bool,
                    replace: dict[str, str]) -> tuple[Any, int | None]:
        """Run ``name`` in the sandbox; returns ``(result, peak bytes or None)``.

        A measured call runs first on random inputs of the same shapes, so that one-time costs (BLAS's
        buffers) fall outside the measurement, then on the real ones, whose peak is read from outside:
        the sandbox's memory cgroup, less the bytes of the inputs. Where the sandbox has no cgroup, the
        worker measures itself (tracemalloc), which its code could forge.
        """
        if measure:  # the decoy: every array replaced by random numbers of its shape and dtype
            arrays: list[np.ndarray] = []
            skeleton = encode((args, kwargs), arrays)
            decoy = decode(skeleton, [RNG.standard_normal(a.shape).astype(a.dtype) for a in arrays])
            with contextlib.suppress(AssertionError):
                self._call(name, decoy, replace, measure=False)
        base = sandbox.reset_peak(self.group) if measure and self.group else None
        result, peak, inputs = self._call(name, (args, kwargs), replace, measure=measure and not self.group)
        return result, (peak if base is None else max(sandbox.peak(self.group) - base - inputs, 0))

    def _call(self, name: str, arguments: tuple, replace: dict[str, str], *,
              measure: bool) -> tuple[Any, int | None, int]:
        """One call in the sandbox: its result, the peak the worker measured, the bytes of the input arrays."""
        arrays: list[np.ndarray] = []
        message = {"op": "call", "name": name, "arguments": encode(arguments, arrays), "measure": measure,
                   "replace": replace}
        reply, results = self.request(message, arrays)
        if not reply.get("ok"):
            raise AssertionError(str(reply.get("message", "the call failed")))
        peak, inputs = reply.get("peak"), sum(a.nbytes for a in arrays)
        return decode(reply.get("result"), results), peak if isinstance(peak, int) else None, inputs

    def _kill(self, reason: str) -> None:
        """Stop the worker, recording why (the first reason stands). Killing the sandbox's first process
        (bwrap's child) is enough: the kernel then ends every process of its pid namespace. Unconfined,
        the worker's process group goes (a process that leaves it survives)."""
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
        sandbox.release(self.group)
        shutil.rmtree(self.copy, ignore_errors=True)


if __name__ == "__main__":
    serve()
