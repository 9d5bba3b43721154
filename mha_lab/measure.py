"""Measuring code on this machine: interleaved timing, peak memory, growth exponents, thread counts.

Timing runs the candidates round-robin, so drift on a shared machine hits all of them alike,
and reports medians. Peak memory: ``tracemalloc`` for NumPy (NumPy reports its buffers to
it); for PyTorch on CPU, the running sum of the allocations and frees that PyTorch's profiler
records. Nothing here imports torch until a torch measurement is asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence

import numpy as np

__all__ = ["interleaved_times", "median_time", "traced_memory", "torch_peak_memory",
           "fit_exponent", "gemm_flops_per_second", "read_bytes_per_second", "cache_sizes", "last_level_cache_bytes",
           "READ_BYTES_MIN", "READ_BYTES_MAX", "read_matrix_bytes", "usable_cores", "fastest_runs",
           "torch_ops_called", "blas_threads", "machine_info"]


def interleaved_times(fns: dict[str, Callable[[], object]], repeat: int = 5, warmup: int = 1,
                      statistic: str = "median", clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median wall time in seconds of each function, running them round-robin ``repeat`` times.

    ``statistic="min"`` reports the fastest run instead: for short calls on a busy machine,
    where other work only ever adds time. ``clock=time.process_time`` measures this process's
    CPU time instead of wall time: for single-threaded work on a machine whose other work
    takes the cores away.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    reduce = np.median if statistic == "median" else np.min
    return {name: float(reduce(t)) for name, t in times.items()}


def fastest_runs(fns: dict[str, Callable[[], object]], runs: int = 3, repeat: int = 5,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Each function's fastest-of-``repeat`` time in seconds, measured ``runs`` times over (``interleaved_times``).
    Each round times every function in turn, so reading r of two functions is a pair under the same load: the
    pairs that ``mha_lab.verdict.paired_margin`` takes its margin from."""
    if runs < 2:
        raise ValueError(f"runs must be at least 2 to show a spread, got {runs}")
    readings: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(runs):
        t = interleaved_times(fns, repeat, warmup=1 if r == 0 else 0, statistic="min", clock=clock)
        for name in fns:
            readings[name].append(t[name])
    return readings


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` calls, after ``warmup`` untimed calls."""
    return interleaved_times({"fn": fn}, repeat, warmup)["fn"]


def traced_memory(fn: Callable[[], object], repeat: int = 1) -> tuple[int, int]:
    """``(retained, peak)`` bytes of ``fn()``, as ``tracemalloc`` sees them (NumPy buffers included).

    ``peak`` is the most that was allocated at once while it ran (its working memory and its
    output, not the arrays that existed before); ``retained`` is what it left allocated once its
    result was dropped: what it stored elsewhere, like a layer's cache for the backward pass.
    ``tracemalloc`` also counts what other threads of the process allocate meanwhile (a client's
    event loop, a kernel's I/O thread), which can only add: with ``repeat`` > 1 each is the smallest
    of that many runs.
    """
    runs = []
    for _ in range(repeat):
        tracemalloc.start()
        try:
            fn()
            runs.append(tracemalloc.get_traced_memory())
        finally:
            tracemalloc.stop()
    return int(min(r for r, _ in runs)), int(min(p for _, p in runs))


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null: the profiler's C++ side logs each start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _profiled_events(fn: Callable[[], object], profile_memory: bool = False) -> list:
    """The events of PyTorch's CPU profiler while ``fn()`` runs.

    ``torch.autograd.profiler.profile`` is the profiler that ``torch.profiler.profile`` wraps, with
    the same events; the wrapper's start also imports ``torch._inductor`` (about two CPU-seconds, the
    first time in a process), which a CPU trace has no use for.
    """
    from torch.autograd.profiler import profile

    with _stderr_silenced(), profile(profile_memory=profile_memory) as prof:
        fn()
    return list(prof.function_events)


def torch_peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes that PyTorch's CPU allocator holds while ``fn()`` runs, from PyTorch's profiler.

    With ``profile_memory=True`` each operator reports the bytes it allocated and the profiler
    logs each free; their running sum in time order peaks at the working memory of ``fn``.
    ``tracemalloc`` cannot see PyTorch's buffers, hence this second method.
    """
    events = sorted(_profiled_events(fn, profile_memory=True), key=lambda e: e.time_range.start)
    running = peak = 0
    for e in events:
        running += e.self_cpu_memory_usage
        peak = max(peak, running)
    return int(peak)


def torch_ops_called(fn: Callable[[], object]) -> set[str]:
    """Names of the PyTorch operators (``aten::...``) that ``fn()`` ran, from PyTorch's profiler."""
    return {e.name for e in _profiled_events(fn)}


def gemm_flops_per_second(n: int = 1024, dtype: str = "float32", repeat: int = 5) -> float:
    """FLOP/s of an (n, n) @ (n, n) BLAS matrix product, 2n^3 FLOPs: the arithmetic ceiling here."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)
    return 2 * n**3 / median_time(lambda: a @ b, repeat=repeat)


def cache_sizes(cpu_dir: str = "/sys/devices/system/cpu/cpu0") -> dict[int, int]:
    """Bytes of each level of data cache that Linux reports for a CPU (CPU 0), by level: {} where it reports none.

    The instruction cache of level 1 is left out: attention's arrays never go there.
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = {}
    for index in sorted(glob.glob(os.path.join(cpu_dir, "cache", "index*"))):
        try:
            with open(os.path.join(index, "level")) as f, open(os.path.join(index, "size")) as g, \
                    open(os.path.join(index, "type")) as t:
                level, size, kind = int(f.read()), g.read().strip(), t.read().strip()
            size_bytes = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size)
        except (OSError, ValueError):  # a file missing, or a size such as "" that is no number of bytes
            continue
        if kind != "Instruction":
            sizes[level] = size_bytes
    return sizes


def last_level_cache_bytes() -> int | None:
    """Size in bytes of the largest CPU cache that Linux reports for CPU 0; None where it reports none."""
    sizes = cache_sizes()
    return sizes[max(sizes)] if sizes else None


READ_BYTES_MIN, READ_BYTES_MAX = 2**28, 2**30
"""The bounds on the size of the matrix ``read_bytes_per_second`` reads by default (256 MiB, 1 GiB)."""


def read_matrix_bytes() -> int:
    """The default size of the matrix ``read_bytes_per_second`` reads: twice the last-level cache, so that
    its bytes come from main memory, kept within ``READ_BYTES_MIN`` and ``READ_BYTES_MAX``."""
    return min(READ_BYTES_MAX, max(READ_BYTES_MIN, 2 * (last_level_cache_bytes() or 0)))


def read_bytes_per_second(n_bytes: int | None = None, repeat: int = 5) -> float:
    """Bytes per second at which a BLAS matrix-vector product reads a float32 matrix of ``n_bytes``:
    the memory ceiling here, for the same kind of operation as a decoding step.

    By default the matrix has ``read_matrix_bytes()``. The time is
    the fastest of ``repeat`` runs: other work on the machine only ever slows a read down. A
    matrix-vector product streams memory faster than ``np.sum`` does on one thread, so a sum would
    understate the ceiling.
    """
    if n_bytes is None:
        n_bytes = read_matrix_bytes()
    cols = 1024
    m = np.ones((max(1, n_bytes // (4 * cols)), cols), dtype=np.float32)  # (rows, cols), n_bytes in all
    v = np.ones(cols, dtype=np.float32)
    seconds = interleaved_times({"matvec": lambda: m @ v}, repeat=repeat, statistic="min")["matvec"]
    return m.nbytes / seconds


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask, which a container's cpuset narrows, where
    ``os.cpu_count()`` counts the whole host; ``os.cpu_count()`` where there is no affinity mask."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    r"""Slope :math:`p` of the least-squares line :math:`\log y = p \log x + c` (y grows like :math:`x^p`)."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if xs.size < 2 or np.unique(xs).size < 2:
        raise ValueError(f"fitting an exponent needs at least two distinct x values, got {xs.tolist()}")
    if np.any(xs <= 0) or np.any(ys <= 0):
        raise ValueError("fitting an exponent on log axes needs positive values")
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def _openblas_threads_fn(suffix: str) -> Callable | None:
    """``openblas_<suffix>`` from the OpenBLAS that NumPy's wheel bundles, whatever its symbol prefix."""
    for lib in glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*.so*")):
        cdll = ctypes.CDLL(lib)
        for prefix in ("scipy_openblas_", "openblas_"):
            for end in ("64_", "_64_", ""):
                fn = getattr(cdll, f"{prefix}{suffix}{end}", None)
                if fn is not None:
                    return fn
    return None


def blas_threads(n: int | None = None) -> int | None:
    """NumPy's OpenBLAS thread count, after setting it to ``n`` when given; None if not OpenBLAS."""
    if n is not None:
        setter = _openblas_threads_fn("set_num_threads")
        if setter is not None:
            setter(ctypes.c_int(n))
    getter = _openblas_threads_fn("get_num_threads")
    return int(getter()) if getter is not None else None


def machine_info(threads: int = 1) -> dict[str, object]:
    """CPU model, the cores this process may run on (``usable_cores``, as ``nproc`` counts them), library
    versions and the thread counts the run uses (pinned to ``threads``)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(threads)
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return {
        "cpu": cpu, "nproc": usable_cores(), "python": platform.python_version(), "numpy": np.__version__,
        "blas": f"{blas.get('name')} {blas.get('version')}", "blas_threads": blas_threads(threads),
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
    }
