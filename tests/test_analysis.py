"""FLOP and memory counts, the KV cache, and the corrected figures of the seed notes."""

import numpy as np
import pytest

from mha_lab.analysis import (
    MODEL_CONFIGS,
    backward_flops_breakdown,
    count_backward_flops,
    count_flops,
    count_memory_bytes,
    dtype_bytes,
    flops_breakdown,
    gb,
    gib,
    kv_cache_bytes,
    memory_breakdown,
    roofline_seconds,
    serving_step_cost,
)
from mha_lab.cpu import GroupedQueryAttention, MultiHeadAttention


@pytest.mark.parametrize("h_kv", [8, 2])
def test_count_flops_counts_the_products_the_layer_performs(h_kv):
    """Counted independently of the formula: 2mnk for every matrix product of a real forward, read off
    the layer's weights and its (B, h, L, L) weights, plus 5 FLOPs per score for the softmax."""
    B, L, d, h = 2, 64, 128, 8
    layer = GroupedQueryAttention(d, h, h_kv, seed=0)
    layer.forward(np.zeros((B, L, d)))
    A = layer.attention_weights  # (B, h, L, L)
    projections = sum(2 * B * L * W.shape[0] * W.shape[1] for W in (layer.W_Q, layer.W_K, layer.W_V, layer.W_O))
    core = 2 * (2 * A.size * layer.d_k)  # Q K^T and A V: (L, d_k) @ (d_k, L) and (L, L) @ (L, d_k) per head
    assert count_flops(B, L, d, h, n_kv_heads=h_kv) == projections + core + 5 * A.size
    assert count_flops(B, L, d, h, n_kv_heads=h_kv) == sum(flops_breakdown(B, L, d, h, n_kv_heads=h_kv).values())


@pytest.mark.parametrize("h", [2, 4, 8, 16])
def test_multi_head_has_the_same_matmul_flops_as_single_head(h):
    """The seed's test: only the softmax term depends on h."""
    B, L, d = 2, 16, 64
    assert count_flops(B, L, d, 1) - 5 * B * 1 * L * L == count_flops(B, L, d, h) - 5 * B * h * L * L


def test_softmax_convention_is_a_parameter():
    a, b = flops_breakdown(1, 8, 16, 2), flops_breakdown(1, 8, 16, 2, softmax_flops=6)
    assert b["softmax"] - a["softmax"] == 2 * 8 * 8 and a["qk"] == b["qk"]


def test_gqa_reduces_only_the_kv_projection():
    mha, gqa = flops_breakdown(1, 32, 4096, 32), flops_breakdown(1, 32, 4096, 32, n_kv_heads=8)
    assert gqa["proj_kv"] * 4 == mha["proj_kv"]
    assert {k: v for k, v in gqa.items() if k != "proj_kv"} == {k: v for k, v in mha.items() if k != "proj_kv"}


def test_corrected_bottleneck_figures():
    """SEED_NOTES 1 and 5: d=4096, L=2048: projections are 4x the core (not 40x); matmul/softmax ~500."""
    f = flops_breakdown(1, 2048, 4096, 32)
    proj = f["proj_q"] + f["proj_kv"] + f["proj_o"]
    core = f["qk"] + f["av"]
    assert proj == pytest.approx(2.75e11, rel=0.01) and core == pytest.approx(6.87e10, rel=0.01)
    assert proj / core == pytest.approx(4.0)  # = 2 d / L


def test_matmul_vs_softmax_factor():
    f = flops_breakdown(1, 2048, 4096, 32)
    matmul = f["proj_q"] + f["proj_kv"] + f["proj_o"] + f["qk"] + f["av"]
    assert matmul == pytest.approx(3.4e11, rel=0.02)
    assert f["softmax"] == pytest.approx(6.7e8, rel=0.01)
    assert 450 < matmul / f["softmax"] < 550


def test_memory_counts():
    B, L, d, h = 2, 128, 64, 8
    assert count_memory_bytes(B, L, d, h, "float64") == (5 * B * L * d + B * h * L * L) * 8
    assert memory_breakdown(B, L, d, h, "float16")["attention_weights"] == B * h * L * L * 2
    assert count_memory_bytes(B, L, d, h, "float32") * 2 == count_memory_bytes(B, L, d, h, "float64")


def test_units_gib_vs_gb():
    """SEED_NOTES 6: a 32x32x8192^2 float32 score tensor is 256 GiB, which is 275 GB."""
    n = 32 * 32 * 8192**2 * dtype_bytes("float32")
    assert gib(n) == 256 and round(gb(n)) == 275


@pytest.mark.parametrize("name, size", [("float16", 2), ("bfloat16", 2), (np.float32, 4), ("float64", 8), ("fp8", 1)])
def test_dtype_bytes(name, size):
    assert dtype_bytes(name) == size


def test_dtype_bytes_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("float7")


def test_llama2_70b_kv_cache_uses_gqa():
    """SEED_NOTES 2: 8 KV heads -> 320 KiB per token, ~1.34 GB at 4096 tokens; MHA would need ~10.7 GB."""
    cfg = MODEL_CONFIGS["Llama-2-70B"]
    assert cfg.kind == "GQA"
    assert kv_cache_bytes(cfg, 1) == 320 * 1024
    assert gb(kv_cache_bytes(cfg, 4096)) == pytest.approx(1.34, abs=0.01)
    assert gib(kv_cache_bytes(cfg, 4096)) == pytest.approx(1.25)
    from dataclasses import replace
    as_mha = replace(cfg, n_kv_heads=cfg.n_heads)
    assert gb(kv_cache_bytes(as_mha, 4096)) == pytest.approx(10.7, abs=0.05)


def test_real_configs_are_consistent():
    for cfg in MODEL_CONFIGS.values():
        assert cfg.n_heads * cfg.head_dim == cfg.d_model, cfg.name
        assert cfg.n_heads % cfg.n_kv_heads == 0, cfg.name
    assert MODEL_CONFIGS["Llama-2-7B"].kind == "MHA" and MODEL_CONFIGS["Llama-3-8B"].n_kv_heads == 8


def test_sliding_window_caps_the_cache():
    m = MODEL_CONFIGS["Mistral-7B"]
    assert kv_cache_bytes(m, 32768) == kv_cache_bytes(m, 4096) == 2 * 32 * 8 * 128 * 4096 * 2
    assert kv_cache_bytes(m, 1000, batch_size=3) == 3 * kv_cache_bytes(m, 1000)


def test_bad_dimensions_raise():
    with pytest.raises(ValueError, match="divisible"):
        count_flops(1, 8, 10, 3)
    with pytest.raises(ValueError, match="divisible"):
        count_memory_bytes(1, 8, 12, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="seq_len"):
        count_flops(1, 0, 8, 2)


@pytest.mark.parametrize("g", [3, 1])
def test_memory_breakdown_is_what_the_layer_caches(g):
    """With GQA too: the layer keeps K and V with g heads, as memory_breakdown counts them."""
    B, L, d, h = 2, 7, 12, 3
    layer = GroupedQueryAttention(d, h, g, seed=0)
    layer.forward(np.random.default_rng(0).standard_normal((B, L, d)))
    cached = {name: a.nbytes for name, a in layer._cache.items()}
    parts = memory_breakdown(B, L, d, h, "float64", n_kv_heads=g)
    assert sum(cached.values()) == count_memory_bytes(B, L, d, h, "float64", n_kv_heads=g)
    assert parts["x"] == cached["X"] and parts["attention_weights"] == cached["A"]
    assert parts["kv"] == cached["K"] + cached["V"] and parts["concat"] == cached["concat"]


def test_backward_flops_match_the_seed_formula():
    B, L, d, h = 2, 96, 64, 8
    assert count_backward_flops(B, L, d, h) == 16 * B * L * d * d + 8 * B * L * L * d + 5 * B * h * L * L
    fwd, bwd = flops_breakdown(B, L, d, h), backward_flops_breakdown(B, L, d, h)
    assert set(fwd) == set(bwd)
    assert all(bwd[k] == 2 * fwd[k] for k in fwd if k != "softmax")
    gqa_fwd, gqa_bwd = flops_breakdown(B, L, d, h, n_kv_heads=2), backward_flops_breakdown(B, L, d, h, n_kv_heads=2)
    assert gqa_bwd["proj_kv"] == 2 * gqa_fwd["proj_kv"] < bwd["proj_kv"]


def test_causal_counts_only_the_pairs_on_or_below_the_diagonal():
    B, L, d, h = 1, 10, 8, 2
    full, causal = backward_flops_breakdown(B, L, d, h), backward_flops_breakdown(B, L, d, h, causal=True)
    pairs = int(np.tril(np.ones((L, L))).sum())  # 55 of 100
    for k in ("qk", "av", "softmax"):
        assert causal[k] * L * L == full[k] * pairs
    assert causal["proj_q"] == full["proj_q"]
    big = flops_breakdown(1, 8192, 64, 1, causal=True)["qk"] / flops_breakdown(1, 8192, 64, 1)["qk"]
    assert big == pytest.approx(0.5, abs=1e-3)
    assert count_flops(B, L, d, h, causal=True) < count_flops(B, L, d, h)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_matmul_flops_equal_the_ones_torch_counts(n_kv_heads):
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from mha_lab.cuda import MultiHeadAttention as TorchMultiHeadAttention

    B, L, d, h = 2, 6, 16, 4
    layer = TorchMultiHeadAttention(d, h, num_kv_heads=n_kv_heads, backend="eager", dtype=torch.float64)
    x = torch.randn(B, L, d, dtype=torch.float64, requires_grad=True)
    with FlopCounterMode(display=False) as forward_count:
        out = layer(x)
    with FlopCounterMode(display=False) as backward_count:
        out.backward(torch.ones_like(out))

    def matmuls(f):
        return sum(v for k, v in f.items() if k != "softmax")

    assert forward_count.get_total_flops() == matmuls(flops_breakdown(B, L, d, h, n_kv_heads=n_kv_heads))
    assert backward_count.get_total_flops() == matmuls(backward_flops_breakdown(B, L, d, h, n_kv_heads=n_kv_heads))


class _Counted(np.ndarray):
    """An array that logs the per-element operations done on it: each elementwise ufunc call (a
    reduction included) costs one per element of its largest operand, an ``einsum`` product with a
    sum two (a multiply and an add); matrix products are left out."""

    log: list[tuple[str, int]] = []

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = [np.asarray(a) if isinstance(a, _Counted) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, _Counted) else o for o in kwargs["out"])
        if ufunc is not np.matmul:
            _Counted.log.append((ufunc.__name__, max(np.size(a) for a in args)))
        result = getattr(ufunc, method)(*args, **kwargs)
        return result.view(_Counted) if isinstance(result, np.ndarray) and result.ndim else result

    def __array_function__(self, func, types, args, kwargs):
        args = tuple(np.asarray(a) if isinstance(a, _Counted) else a for a in args)
        if func is np.einsum:
            _Counted.log.append(("einsum", 2 * max(np.size(a) for a in args if isinstance(a, np.ndarray))))
        result = func(*args, **kwargs)
        return result.view(_Counted) if isinstance(result, np.ndarray) and result.ndim else result


def test_backward_softmax_flops_match_the_operations_the_layer_does():
    """The softmax component of backward_flops_breakdown, against the per-score operations counted
    while the NumPy layer's backward runs (full attention: the layer skips no masked block)."""
    B, L, d, h = 3, 7, 12, 3
    layer = MultiHeadAttention(d_model=d, num_heads=h, seed=0)
    layer.forward(np.random.default_rng(0).normal(size=(B, L, d)).view(_Counted))
    _Counted.log.clear()
    layer.backward(np.ones((B, L, d)).view(_Counted))
    on_scores = sum(n for _, n in _Counted.log if n in (B * h * L * L, 2 * B * h * L * L))
    assert on_scores == backward_flops_breakdown(B, L, d, h)["softmax"] == 5 * B * h * L * L


def test_decode_attention_intensity_is_the_hand_count_for_every_variant():
    """Per cached token, DeepSeek-V2's 128 heads of 128 in bfloat16 (2 bytes), softmax left out:
    cached K/V does 4 h d_k FLOPs on 2 h_kv d_k s bytes, 2 (h / h_kv) / s per byte; absorbed MLA reads
    d_c + d_R = 576 numbers and does 2h(576) + 2h(512) FLOPs; rebuilt MLA adds 4 h d_c d_k of up-projections."""
    from dataclasses import replace

    from mha_lab.analysis import DEEPSEEK_V2, ModelConfig, decode_attention_intensity, decode_step_cost

    def kv(g):
        return replace(DEEPSEEK_V2, n_kv_heads=g, kv_latent_dim=None, rope_head_dim=None)

    def x(config, variant="cached K/V"):
        return decode_attention_intensity(config, "bfloat16", variant, softmax_flops=0)

    assert x(kv(128)) == 4 * 128 * 128 / (2 * 128 * 128 * 2) == 1.0  # MHA
    assert x(kv(8)) == 16.0 and x(kv(1)) == 128.0  # GQA with 8 K/V heads, MQA
    absorbed = x(DEEPSEEK_V2, "MLA absorbed")
    assert absorbed == pytest.approx(2 * 128 * (576 + 512) / (576 * 2)) and absorbed == pytest.approx(241.78, abs=0.01)
    rebuilt = (4 * 128 * 512 * 128 + 2 * 128 * (128 + 64) + 2 * 128 * 128) / (576 * 2)
    assert x(DEEPSEEK_V2, "MLA rebuilt") == pytest.approx(rebuilt)
    # the softmax's 5 FLOPs per score, as in decode_step_cost; the timed float32 layer of the decode chapter
    timed = ModelConfig("timed", 1, 1024, 8, 2, 128)
    cost = decode_step_cost(1024, 8, 2, 4096, batch_size=3, dtype="float32")
    by_hand = (4 * 8 * 128 + 5 * 8) / (2 * 2 * 128 * 4)
    assert decode_attention_intensity(timed, "float32") == cost["attn_flops"] / cost["cache_bytes"] == by_hand
    with pytest.raises(ValueError, match="no latent"):
        decode_attention_intensity(kv(8), variant="MLA absorbed")
    with pytest.raises(ValueError, match="variant"):
        decode_attention_intensity(kv(8), variant="flash")


def test_serving_step_cost_counts_chunks_and_decodes():
    cfg = MODEL_CONFIGS["Llama-3-8B"]  # 32 layers, 32 heads, 8 K/V heads of 128
    cost = serving_step_cost(cfg, 8e9, [(1, 100), (3, 10)], "bfloat16")
    assert cost["weight_flops"] == 2 * 8e9 * 4 and cost["weight_bytes"] == 16e9
    # the decode sees 100 keys; the chunk's three queries see 8, 9 and 10
    assert cost["attn_flops"] == 4 * 32 * 32 * 128 * (100 + 8 + 9 + 10)
    assert cost["cache_bytes"] == 2 * 32 * 8 * 128 * 2 * (101 + 13)
    assert roofline_seconds(10.0, 4.0, 5.0, 1.0) == 4.0 and roofline_seconds(10.0, 1.0, 5.0, 1.0) == 2.0
    with pytest.raises(ValueError, match="new <= context"):
        serving_step_cost(cfg, 8e9, [(5, 4)])
