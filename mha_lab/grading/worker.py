"""The worker protocol: the student's code runs in the sandbox, the grader asks it for calls.

One JSON line per request and per answer, over the sandbox's stdin and stdout. ``run`` executes
the notebook's code cells (their printed output and errors come back for the feedback); ``call``
runs one of the student's functions. Values cross as JSON with arrays in NumPy's ``.npy`` format,
never as pickles, so nothing the sandbox sends can run code in the grader.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np

from mha_lab.grading import checks, sandbox

__all__ = ["encode", "decode", "Worker", "RemoteSubmission", "serve"]

# NumPy functions that may cross by name: pure reductions and ufuncs, nothing that touches files.
NUMPY_FUNCTIONS = frozenset({"sum", "mean", "std", "var", "max", "min", "prod", "median"})
CELL_SECONDS = 60  # one notebook cell, as nbgrader's Execute.timeout was
OUTPUT_CHARS = 20_000  # printed output kept per cell


def _npy(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _from_npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def _numpy_function(name: Any) -> Any:
    """``np.<name>`` when it is a ufunc or one of ``NUMPY_FUNCTIONS``, else None."""
    fn = getattr(np, name, None) if isinstance(name, str) else None
    return fn if isinstance(fn, np.ufunc) or name in NUMPY_FUNCTIONS else None


def encode(value: Any, _arrays: dict[int, int] | None = None) -> Any:
    """A JSON-ready form of arrays, NumPy scalars and functions, numbers, strings, None, lists, tuples,
    dicts and ``checks.SmoothLoss``.

    An array met twice in one value (``(f, x)`` where f holds x) is sent once and referenced after,
    so the receiver sees one array, as the sender did.
    """
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
    if isinstance(value, checks.SmoothLoss):
        return {"__smooth_loss__": encode(value.x, arrays)}
    if _numpy_function(getattr(value, "__name__", "")) is value:
        return {"__numpy__": value.__name__}  # by name: the receiver looks it up in its own NumPy
    return {"__unsupported__": type(value).__name__}


def decode(value: Any, _arrays: list[np.ndarray] | None = None) -> Any:
    """The inverse of ``encode``; an unsupported type comes back as a placeholder string."""
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
        return checks.SmoothLoss(decode(value["__smooth_loss__"], arrays))
    if "__numpy__" in value and _numpy_function(value["__numpy__"]) is not None:
        return _numpy_function(value["__numpy__"])
    return f"<unsupported value of type {value.get('__unsupported__', '?')}>"


# --- the student's side, in the sandbox ----------------------------------------------------------


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the cell ran longer than {CELL_SECONDS} s")


class _Capped(io.StringIO):
    """Printed output that keeps its first ``OUTPUT_CHARS`` characters and drops the rest."""

    def write(self, text: str) -> int:
        return super().write(str(text)[:max(OUTPUT_CHARS - self.tell(), 0)]) if self.tell() < OUTPUT_CHARS else 0


def _run_cell(source: str, namespace: dict) -> list[dict]:
    """Execute one cell; its output as nbformat outputs (printed text, then the error if any)."""
    out, outputs = _Capped(), []
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CELL_SECONDS)
    try:
        with redirect_stdout(out), redirect_stderr(out):
            exec(compile(source, "<cell>", "exec"), namespace)  # noqa: S102 - the student's code, sandboxed
    except BaseException as exc:  # noqa: BLE001 - a broken cell is the student's problem: go on
        outputs.append({"output_type": "error", "ename": type(exc).__name__, "evalue": str(exc), "traceback": []})
    finally:
        signal.alarm(0)
    if out.getvalue():
        outputs.insert(0, {"output_type": "stream", "name": "stdout", "text": out.getvalue()})
    return outputs


def serve() -> None:
    """The worker's main: enter the sandbox, then answer requests on stdin until it closes."""
    sandbox.enter(int(sys.argv[1]))
    channel, requests = os.fdopen(os.dup(1), "w"), sys.stdin
    os.dup2(2, 1)  # the student's prints go to stderr (discarded), never into the channel
    sys.stdout, sys.stdin = sys.stderr, open(os.devnull)  # noqa: SIM115 - for the process's lifetime
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for line in requests:
        request = json.loads(line)
        if request["op"] == "run":
            reply = {"ok": True, "outputs": [_run_cell(source, namespace) for source in request["cells"]],
                     "names": sorted(k for k in namespace if not k.startswith("_"))}
        else:
            try:
                args, kwargs = decode(request["arguments"])
                result, peak = checks.run(namespace, request["name"], args, kwargs, measure=request["measure"],
                                          replace=request["replace"])
                reply = {"ok": True, "result": encode(result), "peak": peak}
            except AssertionError as exc:
                reply = {"ok": False, "message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - e.g. a result NumPy cannot save without pickles
                reply = {"ok": False, "message": f"`{request['name']}` returned a value that cannot be sent: {exc}"}
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


# --- the grader's side ----------------------------------------------------------------------------


class Worker:
    """A worker serving one submission from its sandbox; every request shares one deadline."""

    def __init__(self, folder: Path, limits: sandbox.Limits, *, unsafe: bool = False) -> None:
        self.limits, self.unsafe = limits, unsafe
        self.deadline = time.monotonic() + limits.seconds
        self.copy = sandbox.private_copy(folder, limits)
        self.proc = sandbox.start([sandbox.PYTHON, "-m", "mha_lab.grading.worker", str(limits.processes)], self.copy,
                                  limits, unsafe=unsafe)
        self.stopped = ""  # why the worker is gone, once it is

    def request(self, message: dict) -> dict:
        """Send one request, wait for its answer; AssertionError when the worker dies, hangs or floods."""
        if self.stopped:
            raise AssertionError(self.stopped)
        data, answer = (json.dumps(message) + "\n").encode(), bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdin, selectors.EVENT_WRITE)
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not answer.endswith(b"\n"):
                remaining = self.deadline - time.monotonic()
                events = sel.select(max(remaining, 0)) if remaining > 0 else []
                if not events:
                    return self._stop(f"the submission ran out of its {self.limits.seconds:.0f} s")
                for key, _ in events:
                    if key.fileobj is self.proc.stdin:
                        try:
                            data = data[os.write(key.fd, data[:65536]):]
                        except BrokenPipeError:
                            return self._stop(self._exit_reason())
                        if not data:
                            sel.unregister(self.proc.stdin)
                    else:
                        chunk = os.read(key.fd, 1 << 20)
                        if not chunk:
                            return self._stop(self._exit_reason())
                        answer += chunk
                        if len(answer) > self.limits.output:
                            return self._stop(f"the submission answered more than {self.limits.output} bytes")
        try:
            reply = json.loads(answer)
        except ValueError:
            reply = None
        return reply if isinstance(reply, dict) else self._stop("the submission's worker answered garbage")

    def _exit_reason(self) -> str:
        code = self.proc.wait()
        return f"the submission's process stopped (exit code {code}): did its code call os._exit or crash?"

    def _stop(self, reason: str) -> dict:
        self.close()
        self.stopped = reason
        raise AssertionError(reason)

    def close(self) -> None:
        """Kill the sandbox's first process (bwrap's child): bwrap returns once the kernel has ended every
        process of its pid namespace, so no process of the submission outlives this call."""
        pid = self.proc.pid
        try:
            inner = [] if self.unsafe else Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            inner = []
        for child in inner:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)
        try:
            self.proc.wait(timeout=10 if inner else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        sandbox.release(getattr(self.proc, "memory_group", None))
        shutil.rmtree(self.copy, ignore_errors=True)


class RemoteSubmission(dict):
    """The ``student`` of the hidden checks: the names the notebook defined (placeholders: the objects stay
    in the sandbox), its cells for ``forbid_reference``; calls run in the sandbox, results are judged here."""

    def __init__(self, worker: Worker, names: Sequence[str], allowed: Sequence[str], cells: Sequence[str]) -> None:
        super().__init__({n: f"<{n} in the submission's sandbox>" for n in names})
        self.worker, self.allowed, self.cells = worker, frozenset(allowed), tuple(cells)

    def remote_call(self, name: str, args: tuple, kwargs: dict, *, measure: bool,
                    replace: dict[str, str]) -> tuple[Any, int | None]:
        reply = self.worker.request({"op": "call", "name": name, "arguments": encode((args, kwargs)),
                                     "measure": measure, "replace": replace})
        if not reply.get("ok"):
            raise AssertionError(str(reply.get("message", "the call failed")))
        peak = reply.get("peak")
        return decode(reply.get("result")), peak if isinstance(peak, int) else None


if __name__ == "__main__":
    serve()
