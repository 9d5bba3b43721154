"""The package contract: public names, lazy heavy imports, lint-clean sources."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = {
    "mha_lab.cpu": ["softmax", "softmax_backward", "create_causal_mask", "split_heads", "merge_heads", "repeat_kv",
                    "scaled_dot_product_attention", "SelfAttention", "MultiHeadAttention", "GroupedQueryAttention",
                    "per_head_attention", "head_by_head_forward", "chunked_attention"],
    "mha_lab.analysis": ["count_flops", "count_memory_bytes", "kv_cache_bytes", "MODEL_CONFIGS"],
    "mha_lab.gradcheck": ["numerical_gradient", "relative_error", "check_layer_gradients"],
}


def test_contract_names_are_public():
    import importlib

    for module, names in CONTRACT.items():
        mod = importlib.import_module(module)
        for name in names:
            assert name in mod.__all__, f"{module}.{name} is not in __all__"
            assert callable(getattr(mod, name)) or name == "MODEL_CONFIGS", f"{module}.{name} is not callable"


def test_numpy_half_imports_without_torch_or_triton():
    code = ("import sys, mha_lab, mha_lab.cpu, mha_lab.analysis, mha_lab.gradcheck, mha_lab.testing; "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"heavy modules imported eagerly: {result.stdout} {result.stderr}"


def test_numerical_gradient_of_a_known_function():
    from mha_lab.gradcheck import numerical_gradient, relative_error

    x = np.array([[0.5, -1.0], [2.0, 3.0]])
    assert relative_error(numerical_gradient(lambda: float(np.sum(x**3)), x), 3 * x**2) < 1e-8
    assert np.array_equal(x, [[0.5, -1.0], [2.0, 3.0]]), "numerical_gradient must restore its input"


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_command_answers_its_own_help(capsys):
    """``python -m mha_lab NAME --help`` prints NAME's own usage: the entry point as typed once, in a new
    interpreter, then every command through the same ``main`` in this one (an interpreter's start per command
    cost a second each)."""
    from mha_lab.__main__ import COMMANDS, main

    typed = subprocess.run([sys.executable, "-m", "mha_lab", "grade", "--help"], capture_output=True, text=True,
                           cwd=ROOT)
    assert typed.returncode == 0 and typed.stdout.startswith("usage: python -m mha_lab grade"), typed.stderr
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exited:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert exited.value.code == 0, (name, capsys.readouterr().err)
        assert out.startswith(f"usage: python -m mha_lab {name}") and "COMMAND" not in out, (
            f"{name} --help should print the command's own usage: {out}")
