r"""GPU benchmark: our Triton flash kernel against PyTorch SDPA with its flash backend pinned.

``python -m mha_lab bench --gpu [--quick] [--out DIR]`` times both on B = 4, H = 32, head
sizes 64 and 128, L from 1k to 16k, causal and not, in fp16 and bf16, twice per shape: the
forward alone, and the forward with the backward (the gradients of q, k and v). It prints
achieved TFLOP/s and the ratio ours / SDPA, against the targets of ``TARGETS`` at L >= 2k.
Each forward counts the two matmuls of ``analysis.flops_breakdown``,

.. math:: \text{FLOPs}_\text{fwd} = 4 \cdot B \cdot H \cdot L^2 \cdot D

(:math:`QK^\top` and :math:`PV`, :math:`2L^2D` each per head), with :math:`L(L+1)/2` pairs
instead of :math:`L^2` when causal; the backward counts twice that
(``analysis.backward_flops_breakdown``), so forward plus backward is :math:`3\times` the forward.
Softmax work and the backward's recomputation of :math:`QK^\top` are not counted. Times are the
median of ``triton.testing.do_bench`` (CUDA events, L2 cache flushed between runs). Before timing,
both outputs and all three gradients are compared, since a fast wrong kernel is worth nothing.

``DIR/bench_gpu.json`` holds the device (name, driver, clocks, multiprocessors), the software
versions, the date, a measured bf16 matmul rate for scale, and one row per (shape, pass) with the
tiles the autotuners chose; it is rewritten after every shape, so an interrupted run keeps what it
measured. ``--accuracy`` instead measures the errors of the forward and the backward against the
float32 reference (``DIR/accuracy.json``), and ``--profile`` the GPU time of every kernel of a
forward and backward (``DIR/profile.json``); a later timing run into the same directory carries both
along. ``read_report`` checks a report has every field the book reads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from mha_lab.analysis import flops_breakdown
from mha_lab.tables import markdown_table

__all__ = ["time_ms", "bench_case", "run", "format_table", "device_info", "accuracy_vs_fp32", "accuracy_report",
           "kernel_ms", "profile_report", "read_report",
           "REPORT_FIELDS", "ROW_FIELDS", "TARGETS", "main"]

BATCH, HEADS = 4, 32
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
PASSES = ("forward", "forward+backward")
TARGETS = {"forward": 1.0, "forward+backward": 0.8}  # ratio ours / SDPA flash to reach at L >= TARGET_FROM_L
TARGET_FROM_L = 2048
AGREE_OUT, AGREE_GRAD = 2e-2, 2e-2  # max |ours - SDPA| of the output; relative norm of each gradient's gap
REPORT_FIELDS = ("device", "driver", "sm_clock_max_mhz", "memory_clock_max_mhz", "multiprocessors", "torch",
                 "triton", "cuda", "date", "batch", "heads", "matmul_tflops", "rows", "accuracy", "profile")
ROW_FIELDS = ("dtype", "head_dim", "causal", "seq_len", "pass", "ours_ms", "sdpa_ms", "ours_tflops", "sdpa_tflops",
              "ratio", "ours_tiles")


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``: warm-up, L2 flush, CUDA events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _tiles(kernel) -> str:
    """The tile an autotuned kernel last ran with: '128x64 w8 s3' (BLOCK_M x BLOCK_N, warps, stages)."""
    c = kernel.best_config
    return f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _contenders(dtype: str, head_dim: int, causal: bool, seq_len: int, batch: int, heads: int,
                device: str) -> tuple[dict[str, Callable[[], torch.Tensor]], tuple[torch.Tensor, ...], torch.Tensor]:
    """Random q, k, v (requiring gradients) and an output gradient g of one shape, and the two forwards on them:
    ``({"ours": ..., "sdpa": ...}, (q, k, v), g)``. SDPA is pinned to its flash backend (MATH on a CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mha_lab.cuda import flash

    gen = torch.Generator(device=device).manual_seed(seq_len + head_dim)
    q, k, v, g = (torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=getattr(torch, dtype),
                              generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours() -> torch.Tensor:
        return flash.flash_attention(q, k, v, causal=causal)  # looked up per call, so a test can swap it

    return {"ours": ours, "sdpa": sdpa}, (q, k, v), g


def bench_case(dtype: str, head_dim: int, causal: bool, seq_len: int, batch: int = BATCH,
               heads: int = HEADS, device: str = "cuda") -> list[dict]:
    """Time one shape for both kernels, forward and forward+backward, after checking that they agree.

    Returns two table rows, one per pass. ``device="cpu"`` only makes sense under
    ``TRITON_INTERPRET=1``, to test this harness (SDPA then runs its CPU path).
    """
    from mha_lab.cuda import flash, flash_backward

    forwards, (q, k, v), g = _contenders(dtype, head_dim, causal, seq_len, batch, heads, device)
    ours, sdpa = forwards["ours"], forwards["sdpa"]
    outs = {name: fn() for name, fn in forwards.items()}
    grads = {name: torch.autograd.grad(out, (q, k, v), g) for name, out in outs.items()}
    diff = (outs["ours"].float() - outs["sdpa"].float()).abs().max().item()
    grad_gap = max(_relative_gap(a, b) for a, b in zip(grads["ours"], grads["sdpa"], strict=True))
    where = f"{dtype} D={head_dim} L={seq_len} {'causal' if causal else 'full'}"
    if not diff < AGREE_OUT:
        raise AssertionError(f"kernel and SDPA disagree by {diff:.3g} at {where}")
    if not grad_gap < AGREE_GRAD:
        raise AssertionError(f"kernel and SDPA gradients disagree (relative gap {grad_gap:.3g}) at {where}")
    del outs, grads

    counts = flops_breakdown(batch, seq_len, heads * head_dim, heads, causal=causal)
    forward_flops = counts["qk"] + counts["av"]
    rows = []
    for pass_, flops in zip(PASSES, (forward_flops, 3 * forward_flops), strict=True):
        def step(fn: Callable[[], torch.Tensor], train: bool = pass_ != "forward") -> object:
            if train:
                return torch.autograd.grad(fn(), (q, k, v), g)
            with torch.no_grad():
                return fn()

        ours_ms = time_ms(lambda: step(ours))
        tiles = _tiles(flash._attn_fwd)
        if pass_ != "forward":
            tiles += f"; dK/dV {_tiles(flash_backward._bwd_dkdv)}; dQ {_tiles(flash_backward._bwd_dq)}"
        sdpa_ms = time_ms(lambda: step(sdpa))
        rows.append({"dtype": dtype, "head_dim": head_dim, "causal": causal, "seq_len": seq_len, "pass": pass_,
                     "batch": batch, "heads": heads, "ours_ms": ours_ms, "sdpa_ms": sdpa_ms,
                     "ours_tflops": flops / ours_ms / 1e9, "sdpa_tflops": flops / sdpa_ms / 1e9,
                     "ratio": sdpa_ms / ours_ms, "max_abs_diff": diff, "grad_gap": grad_gap, "ours_tiles": tiles})
    return rows


def accuracy_vs_fp32(dtype: torch.dtype, B: int, H: int, H_kv: int, L: int, D: int, causal: bool,
                     device: str = "cuda") -> dict[str, dict[str, float]]:
    """Max |error| of the output and of dq, dk, dv against autograd through the float32 reference, for the
    kernel and for plain PyTorch in ``dtype`` (``attention_ref(upcast=False)``): ``{"ours": {...}, "torch": {...}}``.

    The dtype-scaled tolerance of the course: the kernel's error may be at most twice plain PyTorch's.
    """
    from mha_lab.cuda.attention import attention_ref
    from mha_lab.cuda.flash import flash_attention

    gen = torch.Generator(device=device).manual_seed(L + D)
    q = torch.randn(B, H, L, D, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(B, H_kv, L, D, device=device, dtype=dtype, generator=gen) for _ in range(2))
    g = torch.randn(B, H, L, D, device=device, dtype=dtype, generator=gen)
    results = {}
    for name, fn in (("ours", lambda *t: flash_attention(*t, causal=causal)),
                     ("torch", lambda *t: attention_ref(*t, causal=causal, upcast=False)),
                     ("ref", lambda *t: attention_ref(*t, causal=causal, upcast=True))):
        leaves = [t.detach().clone().to(torch.float32 if name == "ref" else dtype).requires_grad_(True)
                  for t in (q, k, v)]
        out = fn(*leaves)
        results[name] = [out, *torch.autograd.grad(out, leaves, g.to(out.dtype))]  # out, dq, dk, dv
    return {name: {what: (a.float() - r.float()).abs().max().item()
                   for what, a, r in zip(("out", "dq", "dk", "dv"), results[name], results["ref"], strict=True)}
            for name in ("ours", "torch")}


# (B, H, H_kv, L, D, causal) of the accuracy check, in fp16 and bf16: MHA, GQA with a long causal sequence,
# and a ragged length with a padded head size
ACCURACY_SHAPES = ((4, 16, 16, 2048, 64, False), (2, 16, 4, 4096, 128, True), (2, 12, 3, 1531, 80, True))


def accuracy_report() -> list[dict]:
    """``accuracy_vs_fp32`` on ``ACCURACY_SHAPES`` in fp16 and bf16: one row per (dtype, shape), with each
    error, plain PyTorch's, and whether the kernel's is within twice PyTorch's (the course's tolerance)."""
    rows = []
    for dtype in DTYPES:
        for B, H, H_kv, L, D, causal in ACCURACY_SHAPES:
            errors = accuracy_vs_fp32(getattr(torch, dtype), B, H, H_kv, L, D, causal)
            ok = all(errors["ours"][w] <= 2 * errors["torch"][w] + 1e-5 for w in errors["ours"])
            rows.append({"dtype": dtype, "B": B, "H": H, "H_kv": H_kv, "seq_len": L, "head_dim": D,
                         "causal": causal, "ours": errors["ours"], "torch": errors["torch"], "within_2x": ok})
    return rows


# (dtype, D, causal, L) profiled kernel by kernel: the longest non-causal case, and the short causal one
PROFILE_CASES = (("bfloat16", 128, False, 16384), ("bfloat16", 64, True, 1024))


def kernel_ms(fn: Callable[[], object], calls: int = 5) -> dict[str, float]:
    """GPU milliseconds per call of ``fn``, kernel by kernel (``torch.profiler``'s CUDA activity), after one warm-up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls / 1e3 for e in prof.key_averages() if e.self_device_time_total > 0}


def profile_report() -> list[dict]:
    """For each of ``PROFILE_CASES`` and each kernel (ours, SDPA flash), forward+backward: the median wall time
    of ``time_ms`` and the GPU time of every kernel it launched. Where the kernels' sum falls short of the
    wall time, the GPU waited on the host (Python, launches)."""
    rows = []
    for dtype, head_dim, causal, L in PROFILE_CASES:
        forwards, leaves, g = _contenders(dtype, head_dim, causal, L, BATCH, HEADS, "cuda")
        for name, fn in forwards.items():
            def step(fn: Callable[[], torch.Tensor] = fn, leaves: tuple = leaves, g: torch.Tensor = g) -> object:
                return torch.autograd.grad(fn(), leaves, g)

            kernels = kernel_ms(step)
            rows.append({"dtype": dtype, "head_dim": head_dim, "causal": causal, "seq_len": L, "kernel": name,
                         "wall_ms": time_ms(step), "gpu_ms": sum(kernels.values()), "kernels": kernels})
    return rows


def run(dtypes: tuple[str, ...] = DTYPES, head_dims: tuple[int, ...] = HEAD_DIMS,
        causals: tuple[bool, ...] = (False, True), seq_lens: tuple[int, ...] = SEQ_LENS, progress: bool = True,
        on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every (dtype, D, causal, L) of the grid, two rows each; ``on_rows`` sees the rows so far after each shape."""
    from tqdm.auto import tqdm

    grid = [(dt, D, c, L) for dt in dtypes for D in head_dims for c in causals for L in seq_lens]
    rows: list[dict] = []
    for case in tqdm(grid, desc="GPU attention", disable=not progress):
        rows += bench_case(*case)
        if on_rows is not None:
            on_rows(rows)
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table: dtype, D, causal, L, pass, TFLOP/s of ours and of SDPA, and their ratio."""
    return markdown_table(["dtype", "D", "causal", "L", "pass", "ours TFLOP/s", "SDPA TFLOP/s", "ratio"],
                          [[r["dtype"], r["head_dim"], "yes" if r["causal"] else "no", r["seq_len"], r["pass"],
                            f"{r['ours_tflops']:.1f}", f"{r['sdpa_tflops']:.1f}", f"{r['ratio']:.2f}"] for r in rows])


def worst_ratios(rows: list[dict]) -> dict[str, float | None]:
    """Per pass, the lowest ratio at L >= TARGET_FROM_L (None where no such row was measured)."""
    return {p: min((r["ratio"] for r in rows if r["pass"] == p and r["seq_len"] >= TARGET_FROM_L), default=None)
            for p in PASSES}


def _nvidia_smi(fields: str) -> list[str] | None:
    """``nvidia-smi --query-gpu=FIELDS`` for GPU 0, or None where it cannot be run."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [x.strip() for x in done.stdout.split(",")] if done.returncode == 0 else None


def device_info() -> dict:
    """The GPU and the software: name, driver, clocks (MHz; max and at the moment), multiprocessors, versions, date."""
    import triton

    props = torch.cuda.get_device_properties(0)
    smi = _nvidia_smi("driver_version,clocks.max.sm,clocks.max.mem,clocks.sm,clocks.mem,power.limit") or [None] * 6
    number = lambda x: float(x) if x not in (None, "", "[N/A]") else None  # noqa: E731
    return {"device": props.name, "driver": smi[0], "sm_clock_max_mhz": number(smi[1]),
            "memory_clock_max_mhz": number(smi[2]), "sm_clock_idle_mhz": number(smi[3]),
            "memory_clock_idle_mhz": number(smi[4]), "power_limit_w": number(smi[5]),
            "multiprocessors": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def matmul_tflops(n: int = 8192) -> float:
    """TFLOP/s of one n x n x n bf16 matmul through PyTorch on random data: the machine's tensor-core ceiling."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / time_ms(lambda: a @ b) / 1e9


def read_report(path: Path | str) -> dict:
    """Load a ``bench_gpu.json`` and check it has every field of ``REPORT_FIELDS`` (the accuracy and the profile
    too: a run of the whole ``scripts/gpu_check.sh``) and each row every field of ``ROW_FIELDS``; a ValueError
    names the first one missing or null."""
    report = json.loads(Path(path).read_text())
    missing = [f for f in REPORT_FIELDS if report.get(f) is None]
    if missing:
        raise ValueError(f"{path}: the report has no {missing[0]!r} field")
    for i, row in enumerate(report["rows"]):
        missing = [f for f in ROW_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: row {i} has no {missing[0]!r} field")
    if not report["rows"]:
        raise ValueError(f"{path}: the report has no rows")
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m mha_lab bench --gpu [--quick] [--out DIR] [grid options]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab bench --gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp16 and L <= 4096 only")
    parser.add_argument("--out", default="bench_results", help="directory for bench_gpu.json")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--seq-len", type=int, nargs="+", default=list(SEQ_LENS))
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--accuracy", action="store_true",
                        help="instead of timing: forward and backward errors against the float32 reference "
                             "(accuracy.json); exit 1 if one exceeds twice plain PyTorch's")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the grid: GPU time per kernel of forward+backward on PROFILE_CASES "
                             "(profile.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GPU benchmark needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the CPU benchmark is `python -m mha_lab bench`", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.accuracy:
        rows = accuracy_report()
        (out / "accuracy.json").write_text(json.dumps({**device_info(), "rows": rows}, indent=2))
        print(markdown_table(["dtype", "B, H, H_kv, L, D", "causal", *(f"{w} ours / torch" for w in rows[0]["ours"]),
                              "within 2x"],
                             [[r["dtype"], f"{r['B']}, {r['H']}, {r['H_kv']}, {r['seq_len']}, {r['head_dim']}",
                               r["causal"], *(f"{r['ours'][w]:.2e} / {r['torch'][w]:.2e}" for w in r["ours"]),
                               r["within_2x"]] for r in rows]))
        return 0 if all(r["within_2x"] for r in rows) else 1
    if args.profile:
        rows = profile_report()
        (out / "profile.json").write_text(json.dumps({**device_info(), "rows": rows}, indent=2))
        for r in rows:
            top = sorted(r["kernels"].items(), key=lambda kv: -kv[1])[:4]
            print(f"{r['kernel']} {r['dtype']} D={r['head_dim']} L={r['seq_len']} causal={r['causal']}: wall "
                  f"{r['wall_ms']:.3f} ms, GPU {r['gpu_ms']:.3f} ms: " + "; ".join(f"{k[:40]} {t:.3f}" for k, t in top))
        return 0
    dtypes = tuple(args.dtype[:1] if args.quick else args.dtype)
    seq_lens = tuple(L for L in args.seq_len if L <= 4096 or not args.quick)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    info = {**device_info(), "batch": BATCH, "heads": HEADS, "matmul_tflops": matmul_tflops(), "targets": TARGETS,
            "target_from_seq_len": TARGET_FROM_L}
    print(f"{info['device']} (driver {info['driver']}, SM clock up to {info['sm_clock_max_mhz']} MHz), "
          f"B={BATCH}, H={HEADS}, torch {info['torch']}, triton {info['triton']}; "
          f"bf16 matmul {info['matmul_tflops']:.0f} TFLOP/s", flush=True)

    # carried along from earlier `--accuracy` and `--profile` runs into the same directory, if any
    extra = {name: json.loads((out / f"{name}.json").read_text())["rows"] if (out / f"{name}.json").exists() else None
             for name in ("accuracy", "profile")}

    def save(rows: list[dict], complete: bool = False) -> None:
        report = {**info, "complete": complete, "worst_ratio_from_2k": worst_ratios(rows), "rows": rows, **extra}
        (out / "bench_gpu.json").write_text(json.dumps(report, indent=2))

    rows = run(dtypes, tuple(args.head_dim), causals, seq_lens, progress=not args.no_progress, on_rows=save)
    save(rows, complete=True)
    print(format_table(rows))
    for pass_, worst in worst_ratios(rows).items():
        if worst is not None:
            verdict = "meets" if worst >= TARGETS[pass_] else "misses"
            print(f"{pass_}: worst ratio at L >= {TARGET_FROM_L}: {worst:.2f}, {verdict} the target of "
                  f"{TARGETS[pass_]}")
    print(f"wrote {out / 'bench_gpu.json'}")
    return 0
