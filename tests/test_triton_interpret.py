"""The Triton flash kernel, checked on this CPU with the Triton interpreter.

The interpreter is chosen when the kernel's module is imported, so the whole grid of
``_triton_interpret_cases.py`` runs in ONE subprocess with ``TRITON_INTERPRET=1``; each case
then shows up here as its own test. The interpreter runs each program in Python, so the grid
is a dozen cases, each the smallest shape that reaches its paths (that module's docstring says
which), and ``test_grid_covers_the_required_cases`` keeps it from losing one. The input checks,
which run before any launch, are tested in this process.
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
    assert {16, 32, 64, 128} <= {c["D"] for c in forward} and any(c["D"] & (c["D"] - 1) for c in forward)
    assert {(c["layout"], c["causal"], c["dtype"]) for c in forward} >= {
        (layout, causal, "float64") for layout in ("MHA", "GQA", "MQA") for causal in (False, True)}
    assert any(c["B"] % 2 for c in forward) and any(c.get("strided") for c in forward)
    backward = [c for c in CASES if c["kind"] == "backward"]
    assert {"float32", "float64"} == {c["dtype"] for c in backward}
    assert {c["layout"] for c in backward} == {"MHA", "GQA", "MQA"} and {c["causal"] for c in backward} == {False, True}
    assert any(c["B"] > 1 for c in backward) and any(c.get("strided") for c in backward)
    # past one 16-row tile and ragged, causal and not, so that dK/dV runs its band, bulk and ragged loops
    assert {c["causal"] for c in backward if c["L"] > 16 and c["L"] % 16} == {False, True}
    assert {"module", "errors", "bench"} <= {c["kind"] for c in CASES}


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
