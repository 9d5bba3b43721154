"""The worker: a standalone file the sandbox runs as ``python -S worker.py`` on the student's environment
(the standard library, NumPy, matplotlib; never ``mha_lab``); the grader imports it for the protocol.

Each request and answer is one JSON line and the arrays it carries in ``.npy`` format (``frame``), over
the sandbox's stdin and stdout: ``run`` executes the notebook's code cells (with ``files``: after copying the
submission's files in), ``call`` one of the student's functions, whose helpers named in ``replace`` send
``reference`` requests back to the grader. Nothing crosses as a pickle, so nothing either side sends can run
code in the other. The worker measures nothing: the grader reads memory from the sandbox's cgroup.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import sys
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["encode", "decode", "frame", "read_message", "json_values", "SmoothLoss", "call", "serve", "NOT_AVAILABLE"]

# NumPy functions that may cross by name: pure reductions and ufuncs, nothing that touches files.
NUMPY_FUNCTIONS = frozenset({"sum", "mean", "std", "var", "max", "min", "prod", "median"})
CELL_SECONDS = 60  # one notebook cell, as nbgrader's Execute.timeout was
OUTPUT_CHARS = 20_000  # printed output kept per cell
NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
REFUSED = ("mha_lab", "torch", "scipy")  # not in the student's environment: importing them says so
NOT_AVAILABLE = "{} is not available when graded: write the function yourself"


class SmoothLoss:
    """f() = sum(sin(x) x^2) of the array it holds: an object, not a closure, so that it crosses to the sandbox
    with the very ``x`` a student's code perturbs. Only ``x`` crosses: what the grader knows of f stays there."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def __call__(self) -> float:
        return float(np.sum(np.sin(self.x) * self.x**2))


def _numpy_function(name: Any) -> Any:
    """``np.<name>`` when it is a ufunc or one of ``NUMPY_FUNCTIONS``, else None."""
    fn = getattr(np, name, None) if isinstance(name, str) else None
    return fn if isinstance(fn, np.ufunc) or name in NUMPY_FUNCTIONS else None


def encode(value: Any, arrays: list[np.ndarray], objects: list[Callable] | None = None) -> Any:
    """A JSON-ready form of numbers, strings, containers, NumPy scalars and functions and ``SmoothLoss``;
    arrays go into ``arrays`` (once each, as the sender has them), other callables into ``objects`` if given."""
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
        return {"__tuple__": [encode(v, arrays, objects) for v in value]}
    if isinstance(value, list):
        return [encode(v, arrays, objects) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, arrays, objects), encode(v, arrays, objects)] for k, v in value.items()]}
    if isinstance(value, SmoothLoss):
        return {"__smooth_loss__": encode(value.x, arrays)}
    if _numpy_function(getattr(value, "__name__", "")) is value:
        return {"__numpy__": value.__name__}  # by name: the receiver looks it up in its own NumPy
    if objects is not None and callable(value):
        objects.append(value)
        return {"__callable__": len(objects) - 1}
    return {"__unsupported__": type(value).__name__}


def decode(value: Any, arrays: Sequence[np.ndarray], remote: Callable[[int], Callable] | None = None) -> Any:
    """The inverse of ``encode``; ``remote(i)`` stands for the sender's callable ``i``."""
    if isinstance(value, list):
        return [decode(v, arrays, remote) for v in value]
    if not isinstance(value, dict):
        return value
    if "__ndarray__" in value:
        return arrays[value["__ndarray__"]]
    if "__npscalar__" in value:
        return arrays[value["__npscalar__"]][()]
    if "__tuple__" in value:
        return tuple(decode(v, arrays, remote) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k, arrays, remote): decode(v, arrays, remote) for k, v in value["__dict__"]}
    if "__smooth_loss__" in value:
        return SmoothLoss(decode(value["__smooth_loss__"], arrays))
    if "__numpy__" in value and _numpy_function(value["__numpy__"]) is not None:
        return _numpy_function(value["__numpy__"])
    if "__callable__" in value and remote is not None:
        return remote(int(value["__callable__"]))
    return f"<unsupported value of type {value.get('__unsupported__', '?')}>"


def frame(message: dict, arrays: Sequence[np.ndarray]) -> list[bytes | memoryview]:
    """A JSON line with each array's size, then the arrays in ``.npy`` format, padded to 64 bytes, not copied."""
    parts, sizes = [], []
    for a in arrays:
        a = np.array(a, order="C", copy=None)  # 0-d stays 0-d
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, np.lib.format.header_data_from_array_1_0(a))
        parts += [head.getvalue(), memoryview(a.reshape(-1).view(np.uint8)), bytes(-a.nbytes % 64)]
        sizes.append(head.tell() + a.nbytes + len(parts[-1]))
    return [(json.dumps({**message, "sizes": sizes}) + "\n").encode(), *parts]


def read_message(stream: io.BufferedIOBase, limit: int = 1 << 62, *, text: int | None = None,
                 values: int | None = None) -> tuple[dict, list[np.ndarray]] | None:
    """The next message on ``stream`` (arrays read into place), None at its end; ValueError for anything malformed,
    longer than ``limit`` bytes or pickled, a JSON line longer than ``text`` bytes or with more than ``values``
    lists, objects and items (``json_values``): checked before it is parsed, so that its parsing costs the reader
    a bounded amount of memory."""
    longest = min(limit, text or limit)
    line = stream.readline(longest + 1)
    if not line:
        return None
    if not line.endswith(b"\n") or len(line) > longest:
        raise ValueError(f"a message longer than {longest} bytes before its arrays")
    if values is not None and json_values(line, values) > values:
        raise ValueError(f"a message of more than {values} JSON values")
    message, arrays, start = json.loads(line), [], 0
    sizes = [int(n) for n in message.get("sizes", [])]
    if len(line) + sum(sizes) > limit:
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


def json_values(line: bytes, most: int) -> int:
    """How many lists, objects and items the JSON ``line`` holds (its brackets, commas and colons outside its
    strings), counted until it passes ``most``: in linear time, each string skipped by JSON's own scanner."""
    text, count, at = line.decode("utf-8", "replace"), 0, 0
    while count <= most:
        quote = text.find('"', at)
        stop = len(text) if quote < 0 else quote
        count += sum(text.count(c, at, stop) for c in "[{,:")
        if quote < 0:
            break
        at = json.decoder.scanstring(text, quote + 1)[1]
    return count


class _Refuse:
    """An import hook: the packages of ``REFUSED`` fail with a message that says they are not there."""

    seen: set[str] = set()  # the refused packages the notebook tried to import

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        top = name.partition(".")[0]
        if top in REFUSED:
            self.seen.add(top)
            raise ModuleNotFoundError(NOT_AVAILABLE.format(top), name=name)


def call(namespace: Mapping[str, Any], name: str, args: tuple, kwargs: dict, replace: dict[str, Callable] | None = None
         ) -> Any:
    """``namespace[name](*args, **kwargs)``, the helpers in ``replace`` swapped in; errors become AssertionErrors."""
    fn = namespace.get(name)
    if not callable(fn):
        refused = "".join(f"; {NOT_AVAILABLE.format(m)}" for m in sorted(_Refuse.seen))
        raise AssertionError(f"`{name}` should be a function, got {type(fn).__name__} [bug: not-a-function]"
                             if name in namespace else f"`{name}` is not defined: run the cell that defines it, "
                             f"and keep its name{refused} [bug: {'uses-mha-lab' if refused else 'not-defined'}]")
    scope = getattr(fn, "__globals__", {})
    saved = {attr: scope[attr] for attr in (replace or {}) if attr in scope}
    scope.update({attr: replace[attr] for attr in saved})
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise AssertionError(f"`{name}` is not implemented yet (NotImplementedError) [bug: not-implemented]") from None
    except TypeError as exc:
        raise AssertionError(f"`{name}` raised TypeError: {exc} (check its signature) [bug: signature]") from None
    except Exception as exc:  # noqa: BLE001 - any error of the student's code loses the points, with its reason
        bug = "uses-mha-lab" if "not available when graded" in str(exc) else f"raises-{type(exc).__name__.lower()}"
        raise AssertionError(f"`{name}` raised {type(exc).__name__}: {exc} [bug: {bug}]") from None
    finally:
        scope.update(saved)


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


class _Grader:
    """The pipe to the grader: requests in, answers out."""

    def __init__(self, requests: io.BufferedIOBase, answers: io.BufferedIOBase) -> None:
        self.requests, self.answers = requests, answers

    def send(self, message: dict, arrays: Sequence[np.ndarray]) -> None:
        self.answers.writelines(frame(message, arrays))
        self.answers.flush()

    def reference(self, name: str) -> Callable:
        """A stand-in for the grader's reference ``name``: the grader answers it, calling back the callables it is
        given; every message of the grader's starts with the arrays it was given, as they are there now."""

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            arrays: list[np.ndarray] = []
            objects: list[Callable] = []
            self.send({"op": "reference", "name": name, "arguments": encode((args, kwargs), arrays, objects)}, arrays)
            while (received := read_message(self.requests)) is not None:
                message, data = received
                for mine, theirs in zip(arrays, data, strict=False):  # the grader's copy, changed in place
                    if isinstance(mine, np.ndarray) and mine.flags.writeable and mine.shape == theirs.shape:
                        np.copyto(mine, theirs, casting="unsafe")
                if message.get("op") != "invoke":  # the reference's answer
                    if not message.get("ok"):
                        raise RuntimeError(message.get("message", "the reference failed"))
                    return decode(message.get("result"), data)
                sent: list[np.ndarray] = []
                try:
                    a, kw = decode(message["arguments"], data)
                    self.send({"ok": True, "result": encode(objects[int(message["object"])](*a, **kw), sent)}, sent)
                except Exception as exc:  # noqa: BLE001 - the student's callable failed: the grader says so
                    self.send({"ok": False, "message": f"{type(exc).__name__}: {exc}"}, [])
            raise SystemExit(0)  # the grader has gone

        stand_in.__name__ = name
        return stand_in


def _answer(request: dict, arrays: list[np.ndarray], namespace: dict, grader: _Grader) -> tuple[dict, list]:
    """The reply to one request and the arrays that go with it."""
    if request["op"] == "run":
        if request.get("files"):
            _copy_submission()
        return {"ok": True, "outputs": [_run_cell(source, namespace) for source in request["cells"]]}, []
    sent: list[np.ndarray] = []
    try:
        args, kwargs = decode(request["arguments"], arrays)
        replace = {n: grader.reference(n) for n in request.get("replace", ())}
        result = call(namespace, request["name"], args, kwargs, replace)
        return {"ok": True, "result": encode(result, sent)}, sent
    except AssertionError as exc:
        return {"ok": False, "message": str(exc)}, []
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot cross without pickles
        return {"ok": False, "message": f"`{request['name']}` returned a value that cannot be sent: {exc}"}, []


def _warm_up() -> None:
    """Pay one-time costs that are not the student's before any student code runs: BLAS's buffers, lazy modules."""
    a = np.random.default_rng(0).standard_normal((256, 256))
    np.einsum("ij,jk->ik", a @ a, np.linalg.inv(a + 256 * np.eye(256)))
    np.exp(a).max(axis=-1, keepdims=True).sum()
    tracemalloc.start()
    tracemalloc.stop()


_UNCOPIED: list[Path] = []  # the submission folder, until it is copied to /scratch


def _copy_submission() -> None:
    """Copy the submission's files (not its notebooks: their cells come as requests) to /scratch, once, where
    the code may change them; links stay links. The grader asks for it with the student's first cells, after
    the memory baseline: what the files take in the sandbox's tmpfs is the student's."""
    if not _UNCOPIED:
        return
    _UNCOPIED.clear()
    for entry in Path("/submission").iterdir():  # read-only, as the grader made it
        if entry.suffix == ".ipynb":
            continue
        try:  # a link is never followed: is_dir on a link to what the sandbox may not see raises
            if not entry.is_symlink() and entry.is_dir():  # copytree knows no follow_symlinks
                shutil.copytree(entry, Path("/scratch") / entry.name, symlinks=True)
            else:
                shutil.copy2(entry, Path("/scratch") / entry.name, follow_symlinks=False)
        except OSError:  # e.g. /scratch is full: the file is missing for the student's code, as it would be
            pass


def enter(processes: int) -> None:
    """Before any student code: drop to the sandbox uid, cap processes."""
    uid = os.environ.pop("MHA_LAB_SANDBOX_UID", "")
    if uid and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(*[int(uid)] * 3)
        os.setresuid(*[int(uid)] * 3)
    if uid:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
        _UNCOPIED.append(Path("/submission"))  # copied by the first ``run`` that asks for files
    sys.meta_path.insert(0, _Refuse())
    _warm_up()


def serve() -> None:
    """The worker's main: enter the sandbox, then answer requests on stdin until it closes."""
    enter(int(sys.argv[1]))
    grader = _Grader(sys.stdin.buffer, os.fdopen(os.dup(1), "wb"))
    os.dup2(2, 1)  # the student's prints go to stderr (discarded), never into the channel
    sys.stdout, sys.stdin = sys.stderr, open(os.devnull)  # noqa: SIM115 - for the process's lifetime
    namespace: dict[str, Any] = {"__name__": "__main__"}
    while (received := read_message(grader.requests)) is not None:
        grader.send(*_answer(*received, namespace, grader))
        del received  # before the next request arrives: a measured call starts with nothing of the last one


if __name__ == "__main__":
    serve()
