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
        index = next((i for i, a in enumerate(arrays) if a is value), None)
        if index is None:
            index = len(arrays)
            arrays.append(value)
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


def unframe(line: bytes, payload: bytearray) -> tuple[dict, list[np.ndarray]]:
    """The message and its arrays (views of ``payload``: no copy); ValueError for anything malformed,
    pickled arrays included."""
    message, arrays, start = json.loads(line), [], 0
    for size in message.get("sizes", []):
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


def _read_message(stream: io.BufferedReader) -> tuple[dict, list[np.ndarray]] | None:
    """The next message on ``stream`` (see ``frame``), or None at its end."""
    line = stream.readline()
    if not line:
        return None
    payload = bytearray(sum(json.loads(line).get("sizes", [])))
    view, done = memoryview(payload), 0
    while done < len(payload) and (n := stream.readinto(view[done:])):
        done += n
    return unframe(line, payload)


def serve() -> None:
    """The worker's main: enter the sandbox, then answer requests on stdin until it closes."""
    sandbox.enter(int(sys.argv[1]))
    channel, requests = os.fdopen(os.dup(1), "wb"), sys.stdin.buffer
    os.dup2(2, 1)  # the student's prints go to stderr (discarded), never into the channel
    sys.stdout, sys.stdin = sys.stderr, open(os.devnull)  # noqa: SIM115 - for the process's lifetime
    namespace: dict[str, Any] = {"__name__": "__main__"}
    while (received := _read_message(requests)) is not None:
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


class Worker:
    """A worker serving one submission from its sandbox; every request shares one deadline."""

    def __init__(self, folder: Path, limits: sandbox.Limits, *, unsafe: bool = False) -> None:
        self.limits, self.unsafe = limits, unsafe
        self.deadline = time.monotonic() + limits.seconds
        self.copy = sandbox.private_copy(folder, limits)
        self.proc = sandbox.start([sandbox.PYTHON, "-m", "mha_lab.grading.worker", str(limits.processes)], self.copy,
                                  limits, unsafe=unsafe)
        self.stopped = ""  # why the worker is gone, once it is

    def request(self, message: dict, arrays: Sequence[np.ndarray] = ()) -> tuple[dict, list[np.ndarray]]:
        """Send one request, wait for its answer and its arrays; AssertionError when the worker dies, hangs,
        floods or answers garbage."""
        if self.stopped:
            raise AssertionError(self.stopped)
        data, answer, end, size = b"".join(frame(message, arrays)), bytearray(), 0, None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdin, selectors.EVENT_WRITE)
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while size is None or len(answer) < size:
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
                        continue
                    chunk = os.read(key.fd, 1 << 20)
                    if not chunk:
                        return self._stop(self._exit_reason())
                    answer += chunk
                    if len(answer) > self.limits.output:
                        return self._stop(f"the submission answered more than {self.limits.output} bytes")
                    if size is None and b"\n" in answer:
                        end = answer.index(b"\n") + 1
                        try:
                            size = end + sum(int(n) for n in json.loads(answer[:end]).get("sizes", []))
                        except (ValueError, TypeError, AttributeError):
                            return self._stop("the submission's worker answered garbage")
        try:
            return unframe(bytes(answer[:end]), answer[end:size])
        except (ValueError, TypeError, KeyError, AttributeError):
            return self._stop("the submission's worker answered garbage")

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
        """Run ``name`` in the sandbox; returns ``(result, peak bytes or None)``.

        A measured call runs first on random inputs of the same shapes, so that one-time costs (BLAS's
        buffers) fall outside the measurement, then on the real ones, whose peak is read from outside:
        the sandbox's memory cgroup, less the bytes of the inputs. Where the sandbox has no cgroup, the
        worker measures itself (tracemalloc), which its code could forge.
        """
        group = getattr(self.worker.proc, "memory_group", None)
        if measure:
            with contextlib.suppress(AssertionError):
                self._call(name, _decoy((args, kwargs)), replace, measure=False)
        base = sandbox.reset_peak(group) if measure and group else None
        result, peak, inputs = self._call(name, (args, kwargs), replace, measure=measure and not group)
        return result, (peak if base is None else max(sandbox.peak(group) - base - inputs, 0))

    def _call(self, name: str, arguments: tuple, replace: dict[str, str], *,
              measure: bool) -> tuple[Any, int | None, int]:
        """One call in the sandbox: its result, the peak the worker measured, the bytes of the input arrays."""
        arrays: list[np.ndarray] = []
        message = {"op": "call", "name": name, "arguments": encode(arguments, arrays), "measure": measure,
                   "replace": replace}
        reply, results = self.worker.request(message, arrays)
        if not reply.get("ok"):
            raise AssertionError(str(reply.get("message", "the call failed")))
        peak, inputs = reply.get("peak"), sum(a.nbytes for a in arrays)
        return decode(reply.get("result"), results), peak if isinstance(peak, int) else None, inputs


def _decoy(value: Any) -> Any:
    """``value`` with every array replaced by random numbers of its shape and dtype."""
    arrays: list[np.ndarray] = []
    skeleton, rng = encode(value, arrays), np.random.default_rng()
    return decode(skeleton, [rng.standard_normal(np.shape(a)).astype(a.dtype) for a in arrays])


if __name__ == "__main__":
    serve()
