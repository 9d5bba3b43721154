r"""What the compiler makes of the flash kernel for an NVIDIA GPU, on a machine without one.

Triton compiles ahead of time for a named target: its wheel ships ``ptxas``, so the kernel
of ``mha_lab.cuda.flash`` can be lowered to machine code for an A100 (``sm_80``) or an
H100/H200 (``sm_90``) anywhere. Each build is made with the specialisations a launch on
contiguous tensors gets (head-dimension strides equal to 1, pointers, the other strides and
the length divisible by 16), and reports the three numbers that decide whether a tile
choice can be fast:

* shared memory per program, which must fit the architecture's limit per block
  (``SHARED_MEMORY_BYTES``) and, with the registers, decides how many programs share an SM;
* registers per thread (at most 255);
* register spills in bytes: values that did not fit in registers and go to slow local
  memory. A tile that spills is one the autotuner would only waste time on.

It also says whether the matmuls use tensor cores (``mma`` instructions in the PTX): they
must for fp16 and bf16, and must not for fp32, whose IEEE precision TF32 would break. With
tensor cores it reports how the compiler lays the warps over a tile (``warps_per_cta``, from
the layout in the Triton GPU IR): (num_warps, 1) means each warp owns whole query rows, the
work split of FlashAttention-2.

Building needs no GPU and no driver, only Triton; it takes a second or two per build.
The backward's two gradient kernels (``mha_lab.cuda.flash_backward``) build the same way.
From the command line (``TRITON_INTERPRET`` must not be set)::

    python -m mha_lab compile --arch 90 --dtype float16 --head-dim 128 --causal
    python -m mha_lab compile --arch 90 --dtype bfloat16 --head-dim 128 --kernel dkdv
    python -m mha_lab compile --arch 80 --dtype float32 --head-dim 64 --tile 64,64,8,2 --json
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mha_lab.cuda import flash
from mha_lab.tables import markdown_table

__all__ = ["ARCHITECTURES", "KERNELS", "SHARED_MEMORY_BYTES", "KernelBuild", "build_flash_kernel",
           "build_tile_candidates", "builds_table", "main"]

ARCHITECTURES = {80: "A100 (sm_80)", 90: "H100/H200 (sm_90)"}
# the most shared memory one block may opt into (CUDA programming guide, compute capabilities)
SHARED_MEMORY_BYTES = {80: 163 * 1024, 90: 227 * 1024}
_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _TRITON_TYPES}  # torch.float16 -> "float16"
_POINTERS = ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ")  # tensors in the inputs' dtype
_FLOAT_ROWS = ("LSE", "Delta")  # one float32 per query row
_RUNTIME_SCALARS = ("sm_scale", "H", "N_REP")  # not assumed divisible by 16
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores")
_MMA_WARPS = re.compile(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]")


@dataclass(frozen=True)
class KernelBuild:
    """One compiled variant of the forward kernel and the resources it needs per program."""

    arch: int
    dtype: torch.dtype
    head_dim: int
    causal: bool
    tile: tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    shared_bytes: int
    registers: int
    spill_bytes: int
    tensor_cores: bool
    warps_per_cta: tuple[int, int] | None = None  # how the tensor-core layout lays the warps over (rows, columns)
    kernel: str = "forward"  # one of KERNELS

    @property
    def fits(self) -> bool:
        """Shared memory within the architecture's limit per block, and no register spills."""
        return self.shared_bytes <= SHARED_MEMORY_BYTES[self.arch] and self.spill_bytes == 0


KERNELS = ("forward", "dkdv", "dq")  # the forward and the backward's two gradient kernels


def _kernel_and_constants(kernel: str, dtype: torch.dtype, head_dim: int,
                          causal: bool) -> tuple[triton.JITFunction, dict[str, object]]:
    if kernel == "forward":
        return flash.forward_kernel(dtype, head_dim, causal)  # checks the head size
    from mha_lab.cuda import flash_backward

    return flash_backward.backward_kernels(dtype, head_dim, causal)[kernel]


def build_flash_kernel(arch: int, dtype: torch.dtype, head_dim: int, causal: bool,
                       tile: tuple[int, int, int, int], kernel: str = "forward") -> KernelBuild:
    """Compile one of ``KERNELS`` for compute capability ``arch`` (80 or 90) with one tile; no GPU needed.

    ``kernel`` is the forward (``flash.forward_kernel``) or a gradient kernel of ``flash_backward``;
    dK/dV needs BLOCK_M to divide BLOCK_N, the others BLOCK_N to divide BLOCK_M.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if dtype not in _TRITON_TYPES:
        raise TypeError(f"dtype must be one of {list(_TRITON_TYPES)}, got {dtype}")
    if len(tile) != 4:
        raise ValueError(f"tile is (BLOCK_M, BLOCK_N, num_warps, num_stages), got {tile}")
    block_m, block_n, num_warps, num_stages = tile
    long, short = (block_n, block_m) if kernel == "dkdv" else (block_m, block_n)
    if not all(n >= 16 and n & (n - 1) == 0 for n in (block_m, block_n)) or long % short:
        rule = "BLOCK_M dividing BLOCK_N" if kernel == "dkdv" else "BLOCK_N dividing BLOCK_M"
        raise ValueError(f"BLOCK_M and BLOCK_N must be powers of two >= 16 with {rule}, got {tile}")
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(f"num_warps must be a power of two up to 16 and num_stages >= 1, got {tile}")
    if triton.knobs.runtime.interpret:
        raise RuntimeError("cannot compile for a GPU while TRITON_INTERPRET=1 is set")
    fn, constants = _kernel_and_constants(kernel, dtype, head_dim, causal)
    unit_strides = [n for n in fn.arg_names if n.startswith("stride_") and n.endswith("d")]  # contiguous tensors
    constants.update(BLOCK_M=block_m, BLOCK_N=block_n, **dict.fromkeys(unit_strides, 1))
    pointer = "*" + _TRITON_TYPES[dtype]
    signature = {name: "constexpr" if name in constants else "*fp32" if name in _FLOAT_ROWS
                 else pointer if name in _POINTERS else "fp32" if name == "sm_scale" else "i32"
                 for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name] != "constexpr" and name not in _RUNTIME_SCALARS}
    log = io.StringIO()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope(), redirect_stdout(log):
        triton.knobs.compilation.always_compile = True  # a cached build prints no ptxas log
        triton.knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(ASTSource(fn, signature, constants, aligned), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    registers, spills = _REGISTERS.search(log.getvalue()), _SPILLS.search(log.getvalue())
    if registers is None or spills is None:
        raise RuntimeError(f"no register or spill report in the ptxas log:\n{log.getvalue()}")
    warps = _MMA_WARPS.search(compiled.asm["ttgir"])  # none without tensor cores (fp32)
    return KernelBuild(arch, dtype, head_dim, causal, tuple(tile), int(compiled.metadata.shared),
                       int(registers.group(1)), int(spills.group(1)), "mma" in compiled.asm["ptx"],
                       (int(warps.group(1)), int(warps.group(2))) if warps else None, kernel)


def build_tile_candidates(arch: int, dtype: torch.dtype, head_dim: int, causal: bool,
                          kernel: str = "forward") -> list[KernelBuild]:
    """Build every tile the autotuner may try for this kernel, dtype and head size (``flash.tile_candidates``,
    ``flash_backward.backward_tile_candidates``)."""
    if kernel == "forward":
        tiles = flash.tile_candidates(dtype, head_dim)
    else:
        from mha_lab.cuda.flash_backward import backward_tile_candidates

        tiles = backward_tile_candidates(kernel, dtype, head_dim)
    return [build_flash_kernel(arch, dtype, head_dim, causal, tile, kernel) for tile in tiles]


def builds_table(builds: list[KernelBuild], omit_common: bool = False) -> str:
    """A Markdown table of builds: target, dtype, head size, tile, shared memory, registers, spills.

    With ``omit_common``, columns that hold the same value in every row are left out of the table and
    stated in one line above it, so that a narrow page can show the rest.
    """
    headers = ["GPU", "dtype", "D", "causal", "BLOCK_M x BLOCK_N", "warps", "stages", "shared memory (KiB)",
               "registers / thread", "spilled (bytes)", "tensor cores", "usable"]
    rows = [[ARCHITECTURES[b.arch], _DTYPE_NAMES[b.dtype], b.head_dim, "yes" if b.causal else "no",
             f"{b.tile[0]} x {b.tile[1]}", b.tile[2], b.tile[3], f"{b.shared_bytes / 1024:.0f}", b.registers,
             b.spill_bytes, "yes" if b.tensor_cores else "no", "yes" if b.fits else "NO"] for b in builds]
    if not omit_common or len(rows) < 2:
        return markdown_table(headers, rows)
    common = [i for i in range(len(headers)) if len({str(r[i]) for r in rows}) == 1]
    keep = [i for i in range(len(headers)) if i not in common]
    line = "All builds: " + ", ".join(f"{headers[i]} {rows[0][i]}" for i in common) + ".\n\n"
    return line + markdown_table([headers[i] for i in keep], [[r[i] for i in keep] for r in rows])


def main(argv: list[str] | None = None) -> int:
    """``python -m mha_lab compile``: build the kernel for a GPU target and print what it needs."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab compile", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=sorted(ARCHITECTURES), choices=sorted(ARCHITECTURES))
    parser.add_argument("--dtype", nargs="+", default=["float16"], choices=list(_DTYPE_NAMES.values()))
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--kernel", choices=KERNELS, default="forward",
                        help="the forward, or the backward's dK/dV or dQ kernel")
    parser.add_argument("--tile", action="append", metavar="M,N,WARPS,STAGES",
                        help="build this tile instead of the autotuner's candidates (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the builds as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.tile or []]
    except ValueError:
        parser.error("--tile takes four integers: BLOCK_M,BLOCK_N,num_warps,num_stages")
    builds = []
    try:
        for arch in args.arch:
            for dtype in (getattr(torch, name) for name in args.dtype):
                for head_dim in args.head_dim:
                    if tiles:
                        builds += [build_flash_kernel(arch, dtype, head_dim, args.causal, t, args.kernel)
                                   for t in tiles]
                    else:
                        builds += build_tile_candidates(arch, dtype, head_dim, args.causal, args.kernel)
    except (ValueError, RuntimeError) as err:
        print(f"python -m mha_lab compile: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{**asdict(b), "dtype": _DTYPE_NAMES[b.dtype]} for b in builds]))
    else:
        print(builds_table(builds))
    return 0

