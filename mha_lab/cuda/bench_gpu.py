r"""GPU benchmark: our Triton flash kernel against PyTorch SDPA with its flash backend pinned.

``python -m mha_lab bench --gpu [--quick] [--out DIR]`` times the forward pass of both on
B = 4, H = 32, head sizes 64 and 128, L from 1k to 16k, causal and not, in fp16 and bf16,
and prints achieved TFLOP/s and the ratio ours / SDPA (the target is at least 0.8 at
L >= 2k). Each forward counts the two matmuls of ``analysis.flops_breakdown``,

.. math:: \text{FLOPs} = 4 \cdot B \cdot H \cdot L^2 \cdot D

(:math:`QK^\top` and :math:`PV`, :math:`2L^2D` each per head), with :math:`L(L+1)/2` pairs
instead of :math:`L^2` when causal. Softmax work is not counted. Times are the
median of ``triton.testing.do_bench`` (CUDA events, L2 cache flushed between runs); the
two outputs are compared once per shape before timing, since a fast wrong kernel is worth
nothing. Results go to ``DIR/bench_gpu.json`` with the device name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from mha_lab.analysis import flops_breakdown
from mha_lab.tables import markdown_table

__all__ = ["time_ms", "bench_case", "run", "format_table", "main"]

BATCH, HEADS = 4, 32
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
TARGET_RATIO, TARGET_FROM_L = 0.8, 2048


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``: warm-up, L2 flush, CUDA events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_case(dtype: str, head_dim: int, causal: bool, seq_len: int, batch: int = BATCH,
               heads: int = HEADS, device: str = "cuda") -> dict:
    """Time one shape for both kernels after checking that they agree; returns a table row.

    ``device="cpu"`` only makes sense under ``TRITON_INTERPRET=1``, to test this harness.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mha_lab.cuda.flash import flash_attention

    gen = torch.Generator(device=device).manual_seed(seq_len + head_dim)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=getattr(torch, dtype),
                           generator=gen) for _ in range(3))

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours() -> torch.Tensor:
        return flash_attention(q, k, v, causal=causal)

    diff = (ours().float() - sdpa().float()).abs().max().item()
    if not diff < 2e-2:
        raise AssertionError(f"kernel and SDPA disagree by {diff:.3g} at {dtype} D={head_dim} L={seq_len}")
    counts = flops_breakdown(batch, seq_len, heads * head_dim, heads, causal=causal)
    flops = counts["qk"] + counts["av"]
    ours_ms, sdpa_ms = time_ms(ours), time_ms(sdpa)
    return {"dtype": dtype, "head_dim": head_dim, "causal": causal, "seq_len": seq_len, "batch": batch,
            "heads": heads, "ours_ms": ours_ms, "sdpa_ms": sdpa_ms, "ours_tflops": flops / ours_ms / 1e9,
            "sdpa_tflops": flops / sdpa_ms / 1e9, "ratio": sdpa_ms / ours_ms, "max_abs_diff": diff}


def run(quick: bool = False, progress: bool = True) -> list[dict]:
    """Every (dtype, D, causal, L) of the grid; ``quick`` keeps fp16 and L <= 4k."""
    from tqdm.auto import tqdm

    dtypes = DTYPES[:1] if quick else DTYPES
    seq_lens = [L for L in SEQ_LENS if L <= 4096] if quick else SEQ_LENS
    grid = [(dt, D, c, L) for dt in dtypes for D in HEAD_DIMS for c in (False, True) for L in seq_lens]
    return [bench_case(*case) for case in tqdm(grid, desc="GPU attention", disable=not progress)]


def format_table(rows: list[dict]) -> str:
    """A Markdown table: dtype, D, causal, L, TFLOP/s of ours and of SDPA, and their ratio."""
    return markdown_table(["dtype", "D", "causal", "L", "ours TFLOP/s", "SDPA TFLOP/s", "ratio"],
                          [[r["dtype"], r["head_dim"], "yes" if r["causal"] else "no", r["seq_len"],
                            f"{r['ours_tflops']:.1f}", f"{r['sdpa_tflops']:.1f}", f"{r['ratio']:.2f}"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    """``python -m mha_lab bench --gpu [--quick] [--out DIR]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab bench --gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fp16 and L <= 4096 only")
    parser.add_argument("--out", default="bench_results", help="directory for bench_gpu.json")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GPU benchmark needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the CPU benchmark is `python -m mha_lab bench`", file=sys.stderr)
        return 1
    import triton

    rows = run(quick=args.quick, progress=not args.no_progress)
    device = torch.cuda.get_device_name()
    print(f"{device}, B={BATCH}, H={HEADS}, torch {torch.__version__}, triton {triton.__version__}")
    print(format_table(rows))
    judged = [r["ratio"] for r in rows if r["seq_len"] >= TARGET_FROM_L]
    worst = min(judged, default=None)
    if worst is not None:
        verdict = "meets" if worst >= TARGET_RATIO else "misses"
        print(f"worst ratio at L >= {TARGET_FROM_L}: {worst:.2f}, {verdict} the target of {TARGET_RATIO}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "target_ratio": TARGET_RATIO, "worst_ratio_from_2k": worst, "rows": rows}
    (out / "bench_gpu.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'bench_gpu.json'}")
    return 0
