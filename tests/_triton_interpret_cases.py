"""The Triton kernel on the CPU, under ``TRITON_INTERPRET=1``, against the NumPy reference of ``mha_lab.cpu``.

``test_triton_interpret.py`` runs this file in a subprocess, because the variable must be set
before the kernel's module is imported. By hand::

    TRITON_INTERPRET=1 .venv/bin/python tests/_triton_interpret_cases.py

It prints one JSON object, ``{case id: ""}`` for a pass or the failure's message.

The interpreter runs every program of a launch in Python, so a case costs about its programs
times their key blocks (tiles of 16 x 16 here), and each case is the smallest that reaches the
paths it is there for. Together they cover: MHA, GQA and MQA, each causal and not, in float64;
one query row (L = 1), one ragged tile (L = 7), and lengths past a tile that end in a ragged one
(17, 20, 33, and 97 with seven query tiles, each with its causal band); head sizes 16, 32, 64,
128 and a padded 40; odd batches; strided inputs; a given scale; float32. The backward's cases
reach each of dK/dV's loops (the causal band, the bulk, the ragged last query block, and the key
block past every query) with one, two and four query heads per key/value head; the module's
triton backend runs forward and backward once, the benchmark's harness on one tiny shape, and
the dtypes the interpreter cannot run are refused.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

HEADS = {"MHA": (2, 2), "GQA": (4, 2), "MQA": (4, 1)}  # (query heads, key/value heads)


def _grid() -> list[dict]:
    """Each case the smallest that reaches its paths; the interpreter's cost grows with programs x key blocks."""

    def case(kind, dtype, layout, L, D, B, causal, **extra):
        return {"kind": kind, "dtype": dtype, "L": L, "causal": causal, "layout": layout, "D": D, "B": B, **extra}

    return [
        # forward, float64: each layout causal and not
        case("forward", "float64", "MHA", 97, 64, 1, True),  # 7 query tiles, the last of one row; a band in each
        case("forward", "float64", "MHA", 7, 32, 3, False),  # one ragged tile, odd batch
        case("forward", "float64", "GQA", 1, 16, 2, True, sm_scale=0.3),  # one row; a scale given
        case("forward", "float64", "GQA", 33, 40, 1, False, strided=True),  # padded D, bulk and ragged block
        case("forward", "float64", "MQA", 7, 16, 1, True),  # four query heads on one key/value head
        case("forward", "float64", "MQA", 20, 128, 1, False),  # the widest head
        case("forward", "float32", "GQA", 20, 32, 1, True),  # float32: bulk and band
        # backward: dK/dV's band, bulk and ragged query blocks; the GQA group's loop; dQ as the forward
        case("backward", "float64", "MHA", 33, 40, 1, True, strided=True),
        case("backward", "float64", "GQA", 20, 16, 2, False),
        case("backward", "float32", "MQA", 17, 64, 1, True),
        case("module", "float64", "GQA", 9, 16, 2, True),
        {"kind": "errors"},
        {"kind": "bench"},
    ]


def case_id(case: dict) -> str:
    """A readable id: forward-float64-GQA-L97-D32-causal."""
    if case["kind"] in ("errors", "bench"):
        return case["kind"]
    extras = [k for k in ("strided",) if case.get(k)] + ([f"scale{case['sm_scale']}"] if "sm_scale" in case else [])
    parts = [case["kind"], case["dtype"], case["layout"], f"L{case['L']}", f"D{case['D']}", f"B{case['B']}",
             "causal" if case["causal"] else "full", *extras]
    return "-".join(parts)


CASES = _grid()


def numpy_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, sm_scale: float | None) -> np.ndarray:
    """mha_lab.cpu's attention in float64, K/V heads repeated with repeat_kv, the scale folded into Q."""
    from mha_lab.cpu import create_causal_mask, repeat_kv, scaled_dot_product_attention

    n_rep = q.shape[1] // k.shape[1]
    D, L = q.shape[-1], q.shape[-2]
    if sm_scale is not None:
        q = q * (sm_scale * math.sqrt(D))  # the reference always divides by sqrt(D)
    out, _ = scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                          mask=create_causal_mask(L) if causal else None)
    return out


def _inputs(case: dict, torch):
    """q, k, v as torch tensors in the case's dtype (transposed views when ``strided``)."""
    H, H_kv = HEADS[case["layout"]]
    B, L, D = case["B"], case["L"], case["D"]
    rng = np.random.default_rng(L * 1000 + D)
    dtype = getattr(torch, case["dtype"])
    tensors = []
    for heads in (H, H_kv, H_kv):
        if case.get("strided"):  # stored (B, L, heads, D) as after a projection; viewed as (B, heads, L, D)
            tensors.append(torch.from_numpy(rng.standard_normal((B, L, heads, D))).to(dtype).transpose(1, 2))
        else:
            tensors.append(torch.from_numpy(rng.standard_normal((B, heads, L, D))).to(dtype))
    return tensors


def run_forward(case: dict) -> None:
    import torch

    from mha_lab.cuda.flash import flash_attention
    from mha_lab.testing import assert_close

    q, k, v = _inputs(case, torch)
    if case.get("strided"):
        assert not q.is_contiguous()
    out = flash_attention(q, k, v, causal=case["causal"], sm_scale=case.get("sm_scale"))
    assert out.dtype == q.dtype and out.shape == q.shape, (out.dtype, out.shape)
    expected = numpy_reference(*(t.double().numpy() for t in (q, k, v)), case["causal"], case.get("sm_scale"))
    assert_close(out.numpy(), expected, dtype=case["dtype"])


def run_backward(case: dict) -> None:
    """Gradients of the kernel (its Triton backward) against torch autograd through the plain reference."""
    import torch

    from mha_lab.cuda.attention import attention_ref
    from mha_lab.cuda.flash import flash_attention
    from mha_lab.testing import assert_close

    inputs = _inputs(case, torch)
    grad = torch.from_numpy(np.random.default_rng(1).standard_normal(inputs[0].shape)).to(inputs[0].dtype)
    grads = {}
    for name, fn in (("kernel", flash_attention), ("reference", attention_ref)):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves, causal=case["causal"])
        grads[name] = torch.autograd.grad(out, leaves, grad)
    for name, got, want in zip("qkv", grads["kernel"], grads["reference"], strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got.numpy(), want.numpy(), dtype=case["dtype"], err_msg=f"d{name}")


def run_module(case: dict) -> None:
    """MultiHeadAttention(backend="triton") built from a NumPy layer: output, grad X and every weight gradient."""
    import torch

    from mha_lab.cpu import GroupedQueryAttention, create_causal_mask
    from mha_lab.cuda import MultiHeadAttention
    from mha_lab.testing import assert_close

    H, H_kv = HEADS[case["layout"]]
    B, L, d_model = case["B"], case["L"], H * case["D"]
    layer = GroupedQueryAttention(d_model, H, H_kv, use_bias=True, seed=L)
    rng = np.random.default_rng(L)
    for name in ("b_Q", "b_K", "b_V", "b_O"):
        setattr(layer, name, rng.standard_normal(getattr(layer, name).shape))
    X, G = rng.standard_normal((B, L, d_model)), rng.standard_normal((B, L, d_model))
    expected = layer.forward(X, create_causal_mask(L) if case["causal"] else None)
    expected_grad_X = layer.backward(G)
    module = MultiHeadAttention.from_numpy(layer, causal=case["causal"], backend="triton")
    Xt = torch.from_numpy(X).requires_grad_(True)
    out = module(Xt)
    (out * torch.from_numpy(G)).sum().backward()
    assert_close(out.detach().numpy(), expected, err_msg="forward")
    assert_close(Xt.grad.numpy(), expected_grad_X, err_msg="grad X")
    for name, g in layer.gradients().items():
        assert_close(getattr(module, name).grad.numpy(), g, err_msg=f"grad {name}")


def run_errors(case: dict) -> None:
    """Dtypes the interpreter cannot run are refused with a message, before any launch."""
    import torch

    from mha_lab.cuda.flash import flash_attention

    for dtype in (torch.bfloat16, torch.float16):
        q = torch.zeros(1, 2, 8, 16, dtype=dtype)
        try:
            flash_attention(q, q, q)
        except TypeError as err:
            assert "not supported by the Triton interpreter" in str(err), err
        else:
            raise AssertionError(f"{dtype} was accepted by the interpreter")


def run_bench(case: dict) -> None:
    """The GPU benchmark's harness on one tiny shape: the agreement checks, the rows' arithmetic, and that a
    wrong forward or a wrong backward stops it. Times come from a CPU clock here, so only their bookkeeping
    is checked."""
    import time

    import mha_lab.cuda.flash as flash
    from mha_lab.cuda import bench_gpu

    def cpu_time_ms(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    bench_gpu.time_ms = cpu_time_ms  # do_bench needs CUDA events
    L = 17  # two query tiles, the second of one row
    forward, train = bench_gpu.bench_case("float32", 16, True, L, batch=1, heads=2, device="cpu")
    assert (forward["pass"], train["pass"]) == bench_gpu.PASSES, (forward, train)
    assert forward["max_abs_diff"] < 1e-5 and forward["grad_gap"] < 1e-5, forward
    flops = 4 * 2 * (L * (L + 1) // 2) * 16  # H=2 heads, L(L+1)/2 causal pairs, 2D FLOPs each in QK^T and in PV
    for row, counted in ((forward, flops), (train, 3 * flops)):  # the backward counts its four products
        assert math.isclose(row["ratio"], row["sdpa_ms"] / row["ours_ms"]), row
        assert math.isclose(row["ours_tflops"], counted / row["ours_ms"] / 1e9), row
        assert set(bench_gpu.ROW_FIELDS) <= set(row), row
    assert train["ours_tiles"] == "16x16 w1 s1; dK/dV 16x16 w1 s1; dQ 16x16 w1 s1", train
    right = {"flash_attention": flash.flash_attention, "flash_backward": flash.flash_backward}
    wrong = {"disagree by": (flash, "flash_attention",  # the wrong mask
                             lambda q, k, v, causal=False: right["flash_attention"](q, k, v, causal=not causal)),
             "gradients disagree": (flash, "flash_backward",  # the autograd Function's backward, 10% too large
                                    lambda *args: tuple(1.1 * g for g in right["flash_backward"](*args)))}
    for message, (module, name, broken) in wrong.items():
        setattr(module, name, broken)
        try:
            bench_gpu.bench_case("float32", 16, True, L, batch=1, heads=2, device="cpu")
        except AssertionError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"a wrong {name} was timed")
        finally:
            setattr(module, name, right[name])


RUNNERS = {"forward": run_forward, "backward": run_backward, "module": run_module, "errors": run_errors,
           "bench": run_bench}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the kernel must be built for the interpreter", file=sys.stderr)
        return 2
    results = {}
    for case in CASES:
        try:
            RUNNERS[case["kind"]](case)
            results[case_id(case)] = ""
        except Exception as err:  # report every case, not just the first failure
            results[case_id(case)] = f"{type(err).__name__}: {err}"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
