"""The Triton flash kernel, checked on this CPU with the Triton interpreter.

The interpreter is chosen when the kernel's module is imported, so the whole grid of
``_triton_interpret_cases.py`` runs in ONE subprocess with ``TRITON_INTERPRET=1``; each case
then shows up here as its own test. The input checks, which run before any launch, are tested
in this process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from _triton_interpret_cases import CASES, case_id  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.run([sys.executable, str(HERE / "_triton_interpret_cases.py")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", [case_id(c) for c in CASES])
def test_kernel_under_interpreter(interpreter_results, case):
    assert case in interpreter_results, f"{case} did not run"
    assert interpreter_results[case] == "", interpreter_results[case]


def test_grid_covers_the_required_cases():
    forward = [c for c in CASES if c["kind"] == "forward"]
    assert {1, 7, 97} <= {c["L"] for c in forward}
    assert {16, 32, 64} <= {c["D"] for c in forward}
    assert {(c["layout"], c["causal"], c["dtype"]) for c in forward} >= {
        (layout, causal, "float64") for layout in ("MHA", "GQA", "MQA") for causal in (False, True)}
    assert {"float32", "float64"} == {c["dtype"] for c in CASES if c["kind"] == "backward"}


def _qkv(B=1, H=4, H_kv=2, L=8, D=16, dtype=torch.float32):
    return torch.zeros(B, H, L, D, dtype=dtype), torch.zeros(B, H_kv, L, D, dtype=dtype), \
        torch.zeros(B, H_kv, L, D, dtype=dtype)


@pytest.mark.parametrize("args, error, match", [
    (_qkv(H=4, H_kv=3), ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    (_qkv(D=8), ValueError, "head size D=8 is not supported"),
    (_qkv(D=256), ValueError, "head size D=256 is not supported"),
    ((torch.zeros(4, 8, 16),) * 3, ValueError, "rank 4"),
    ((torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 9, 16), torch.zeros(1, 2, 9, 16)), ValueError, "must agree"),
    ((torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 1, 8, 16)), ValueError, "same shape"),
    ((torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16, dtype=torch.float64), torch.zeros(1, 2, 8, 16)), TypeError,
     "share a dtype"),
    (("q", "k", "v"), TypeError, "torch.Tensor"),
    ((torch.zeros(1, 1, 1, 16).expand(65536, 1, 1, 16),) * 3, ValueError, "exceeds the launch grid"),
])
def test_wrapper_validates_before_launching(args, error, match):
    from mha_lab.cuda.flash import flash_attention

    with pytest.raises(error, match=match):
        flash_attention(*args)


def test_wrapper_refuses_cpu_tensors_without_the_interpreter():
    from mha_lab.cuda.flash import flash_attention

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    with pytest.raises(RuntimeError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
        flash_attention(*_qkv())
    with pytest.raises(ValueError, match="sm_scale"):
        flash_attention(*_qkv(), sm_scale=-1.0)


def _compile_for_gpu(dtype: torch.dtype, D: int, causal: bool, arch: int):
    """Compile ``_attn_fwd`` ahead of time for an NVIDIA target, specialised as a launch on
    contiguous (B, 32, 4096, D) tensors would be (unit strides folded in, the rest 16-divisible)."""
    from triton import compile as triton_compile
    from triton import next_power_of_2
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mha_lab.cuda.flash import _attn_fwd, _gpu_tiles

    H, L = 32, 4096
    ty = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    block_d = max(next_power_of_2(D), 16)
    block_m, block_n, num_warps, num_stages = _gpu_tiles(dtype, block_d)[0]  # the first candidate
    ints = {f"stride_{t}{axis}": value for t in "qkvo"
            for axis, value in zip(("b", "h", "m" if t in "qo" else "n", "d"), (H * L * D, L * D, D, 1), strict=True)}
    ints.update(H=H, N_REP=1, L=L)
    constants = {name: value for name, value in ints.items() if value == 1}
    constants.update(HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                     DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    signature = {name: f"*{ty}" for name in ("Q", "K", "V", "Out")}
    signature.update(LSE="*fp32", sm_scale="fp32", **{name: "i32" for name in ints})
    signature.update({name: "constexpr" for name in constants})
    kernel = _attn_fwd.fn  # the @triton.jit function under the autotuner
    names = list(kernel.arg_names)
    aligned = [n for n in names if n in ("Q", "K", "V", "Out", "LSE") or ints.get(n, 1) % 16 == 0]
    src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()},
                    {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton_compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.slow
@pytest.mark.parametrize("dtype, D, causal, arch, tensor_cores", [
    (torch.float16, 64, True, 90, True), (torch.bfloat16, 128, False, 90, True), (torch.float32, 40, True, 80, False),
])
def test_gpu_build_compiles_and_fits_in_shared_memory(dtype, D, causal, arch, tensor_cores):
    """The CUDA path never runs here, so compile it for A100 (sm_80) and H100 (sm_90) without a GPU.

    Half precision must use tensor cores (mma); float32 must not, since TF32 would break its precision.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    kernel = _compile_for_gpu(dtype, D, causal, arch)
    assert ("mma" in kernel.asm["ptx"]) == tensor_cores
    assert 0 < kernel.metadata.shared <= 227 * 1024, f"{kernel.metadata.shared} bytes of shared memory"


@pytest.mark.parametrize("dtype, D, first", [
    (torch.float16, 64, (128, 64, 4, 3)), (torch.bfloat16, 40, (128, 64, 4, 3)), (torch.float16, 128, (128, 64, 8, 3)),
    (torch.float32, 64, (64, 32, 4, 2)),
])
def test_autotuner_times_only_the_tiles_listed_for_the_launch(dtype, D, first):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    from triton import next_power_of_2

    from mha_lab.cuda.flash import _attn_fwd, _gpu_tiles, _prune_tiles

    block_d = max(next_power_of_2(D), 16)
    kept = _prune_tiles(_attn_fwd.configs, {"Q": torch.zeros(1, dtype=dtype)}, BLOCK_D=block_d, HEAD_DIM=D)
    tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
    assert sorted(tiles) == sorted(_gpu_tiles(dtype, block_d)) and _gpu_tiles(dtype, block_d)[0] == first
    assert all(m % n == 0 for m, n, _, _ in tiles), "the kernel needs BLOCK_M to be a multiple of BLOCK_N"
