"""The benchmark on a tiny grid: structure, agreement checks, files and figures. No timing assertions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure

from mha_lab import bench
from mha_lab.__main__ import main as cli_main
from mha_lab.analysis import count_backward_flops, count_flops
from mha_lab.bench import BenchResults, run_suite
from mha_lab.bench_parts import FORWARD_PARTS, ForwardParts, fixed_rate_seconds, forward_part_flops
from mha_lab.bench_tiles import RUNNING_MAX, TILES, default_tile, tile_calls, tile_name
from mha_lab.cpu import MultiHeadAttention
from mha_lab.plots.bench import implementations_bar, memory_vs_length, time_vs_length
from mha_lab.testing import tolerances

torch = pytest.importorskip("torch")

TINY = {"B": 1, "d_model": 32, "lengths": (16, 48), "heads": (2, bench.TARGET_H), "memory_lengths": (16, 48),
        "backward_lengths": (16, 48), "parts_lengths": (16, 48), "tiles_lengths": (48,), "repeat": 2, "gemm_n": 64,
        "tp_ranks": (), "cp_ranks": ()}  # these rows start processes: tests/test_*_distributed.py cover them
FORWARD_IMPLS = {("numpy fused", "float64"), ("numpy fused", "float32"), ("per-head loop", "float64"),
                 ("head by head", "float64"), ("chunked", "float64"), ("torch eager", "float64"),
                 ("torch SDPA", "float64"), ("torch nn.MultiheadAttention", "float64")}


@pytest.fixture(scope="module")
def results() -> BenchResults:
    return run_suite(grid=TINY, progress=False)


def test_every_section_and_implementation_is_measured(results):
    assert {r["section"] for r in results.rows} == {"forward", "parts", "tiles", "backward", "memory", "gemm"}
    for L in TINY["lengths"]:
        for h in TINY["heads"]:
            got = {(r["impl"], r["dtype"]) for r in results.select(section="forward", L=L, h=h)}
            assert got == FORWARD_IMPLS, (L, h)
    for L in TINY["memory_lengths"]:
        rows = results.select(section="memory", L=L)
        assert {(r["impl"], r["dtype"]) for r in rows} == FORWARD_IMPLS
        assert all(r["peak_bytes"] > 0 for r in rows if r["impl"] != "torch SDPA")
        assert {r["memory_method"] for r in rows} == {"tracemalloc", "torch.profiler"}
    backward = {r["impl"] for r in results.select(section="backward")}
    assert backward == {"numpy backward", "torch autograd eager", "torch autograd SDPA"}
    assert {r["dtype"] for r in results.select(section="gemm")} == {"float64", "float32"}
    for L in TINY["parts_lengths"]:
        rows = results.select(section="parts", L=L)
        assert [r["impl"] for r in rows] == list(FORWARD_PARTS)
        assert all(r["seconds"] > 0 and r["h"] == bench.TARGET_H for r in rows)
        assert sum(r["flops"] for r in rows) == count_flops(TINY["B"], L, TINY["d_model"], bench.TARGET_H)
    tiles = results.select(section="tiles", L=48)
    assert [r["impl"] for r in tiles] == [tile_name(t) for t in TILES] + [tile_name(default_tile()) + RUNNING_MAX]
    assert sum(r["impl"].endswith("(default)") for r in tiles) == 1 and default_tile() in TILES
    assert all(r["seconds"] > 0 and r["gemm_fraction"] > 0 for r in tiles)


def test_each_tile_computes_the_same_forward():
    layer = MultiHeadAttention(32, 4, seed=0)
    X = np.random.default_rng(1).standard_normal((2, 40, 32))
    reference = layer.forward(X)
    for name, call in tile_calls(layer, X).items():
        np.testing.assert_allclose(call(), reference, err_msg=name, **tolerances("float64"))


def test_rows_carry_shape_flops_and_gemm_fraction(results):
    for r in results.select(section="forward"):
        assert (r["B"], r["d_model"]) == (TINY["B"], TINY["d_model"])
        assert r["seconds"] > 0
        assert r["flops"] == bench.count_flops(r["B"], r["L"], r["d_model"], r["h"])
        assert r["gflops"] == pytest.approx(r["flops"] / r["seconds"] / 1e9)
        assert r["gemm_fraction"] > 0
    for r in results.select(section="backward"):
        assert r["flops"] == bench.count_flops(r["B"], r["L"], r["d_model"], r["h"]) + count_backward_flops(
            r["B"], r["L"], r["d_model"], r["h"])
    gemm = results.select(section="gemm", dtype="float64")[0]
    assert gemm["flops"] == 2 * TINY["gemm_n"] ** 3


def test_machine_and_threads_are_reported(results):
    m = results.machine
    assert m["nproc"] >= 1 and m["numpy"] == np.__version__ and m["torch"] == torch.__version__
    assert m["torch_threads"] == 1
    assert m["blas_threads"] in (1, None)  # None only when NumPy's BLAS is not OpenBLAS


def test_ratios_and_exponents_are_computed(results):
    ratios = results.ratios()
    assert len(ratios) == 6
    assert all(r["measured"] is not None and r["measured"] > 0 for r in ratios)
    assert [r["passed"] is None for r in ratios] == [True, False, True, True, True, False]  # tiny L: not judged
    fits = {(f["quantity"], f["impl"], f["dtype"], f["h"]) for f in results.exponents()}
    assert ("memory", "chunked", "float64", bench.TARGET_H) in fits
    assert ("time", "numpy fused", "float64", 2) in fits


def test_ratio_logic_on_known_rows():
    def row(section, impl, L, seconds=None, peak=None):
        return bench._row(section, impl, "float64", 2, L, 64, bench.TARGET_H, seconds=seconds, peak_bytes=peak,
                          gemm={"float64": half_of_chunked})

    half_of_chunked = count_flops(2, 4096, 64, bench.TARGET_H) / 16.0 / 1e9 * 2  # chunked's GFLOP/s below, doubled

    r = BenchResults(rows=[
        row("forward", "numpy fused", 1024, seconds=2.5), row("forward", "torch SDPA", 1024, seconds=1.0),
        row("forward", "numpy fused", 4096, seconds=10.0), row("forward", "chunked", 4096, seconds=16.0),
        row("forward", "torch SDPA", 4096, seconds=1.0),  # beyond L=1024: must not be used for the first target
        row("memory", "chunked", 256, peak=100), row("memory", "chunked", 4096, peak=1600),
        row("memory", "numpy fused", 4096, peak=32000),
        row("backward", "numpy backward", 1024, seconds=2.0), row("backward", "torch autograd SDPA", 1024, seconds=1.0),
    ])
    assert [x["measured"] for x in r.ratios()] == pytest.approx([2.5, 1.0, 20.0, 1.6, 0.5, 2.0])
    assert [x["passed"] for x in r.ratios()] == [False, True, True, False, False, True]
    assert [(x["target"], x["limit"]) for x in r.ratios()] == [(t.name, t.limit) for t in bench.TARGETS]


@pytest.mark.parametrize("B, L, d_model, h", [(1, 1, 8, 1), (3, 7, 24, 3), (2, 97, 64, 8)])
def test_forward_parts_compute_the_forward_and_its_count(B, L, d_model, h):
    layer = MultiHeadAttention(d_model, h, use_bias=True, seed=3)
    X = np.random.default_rng(4).standard_normal((B, L, d_model))
    parts = ForwardParts(layer, X)
    out = layer.forward(X)
    np.testing.assert_array_equal(parts.out, out)  # the same operations in the same order: bit for bit
    np.testing.assert_array_equal(parts.A, layer.attention_weights)
    assert parts.flops == forward_part_flops(B, L, d_model, h)
    assert sum(parts.flops.values()) == count_flops(B, L, d_model, h)
    assert parts.flops["projections"] == 8 * B * L * d_model**2 and parts.flops["softmax"] == 5 * B * h * L * L
    calls = parts.calls()
    assert list(calls) == list(FORWARD_PARTS)
    (Q, K, V), projected = calls["projections"]()
    np.testing.assert_array_equal(projected, out)
    np.testing.assert_array_equal(calls["weighted values"](), parts.Z)
    d_k = d_model // h
    np.testing.assert_allclose(row_softmax(calls["scores"]() / np.sqrt(d_k)), parts.A, **tolerances("float64"))
    # the softmax runs in place on a copy of A, so its first call is the softmax of A / sqrt(d_k)
    np.testing.assert_allclose(calls["softmax"](), row_softmax(parts.A / np.sqrt(d_k)), **tolerances("float64"))


def row_softmax(x: np.ndarray) -> np.ndarray:
    """A softmax written out apart from the package's, to check it against."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_part_shares_of_chosen_rows():
    def row(part, flops, seconds):
        return bench._row("parts", part, "float64", 1, 128, 64, bench.TARGET_H, seconds=seconds, flops=flops)

    r = BenchResults(rows=[row("projections", 6e6, 1e-4), row("softmax", 2e6, 3e-4),
                           bench._row("forward", "numpy fused", "float64", 1, 128, 64, bench.TARGET_H, seconds=1.0)])
    shares = r.part_shares(128)
    assert shares["projections"] == pytest.approx({"flops_share": 0.75, "time_share": 0.25, "gflops": 60})
    assert shares["softmax"] == pytest.approx({"flops_share": 0.25, "time_share": 0.75, "gflops": 2e6 / 3e-4 / 1e9})
    with pytest.raises(ValueError, match="no parts measured at L=256"):
        r.part_shares(256)


def test_fixed_rate_seconds_divides_each_part_by_its_rate():
    equal = dict.fromkeys(FORWARD_PARTS, 2.0)  # one rate for all: the count over that rate
    assert fixed_rate_seconds(equal, 2, 96, 64, 8) == pytest.approx(count_flops(2, 96, 64, 8) / 2e9)
    slow_softmax = {**equal, "softmax": 0.5}  # four times slower: three times its share added
    extra = 3 * forward_part_flops(2, 96, 64, 8)["softmax"] / 2e9
    assert fixed_rate_seconds(slow_softmax, 2, 96, 64, 8) == pytest.approx(count_flops(2, 96, 64, 8) / 2e9 + extra)


def test_wrong_implementation_is_caught():
    reference = np.ones((2, 3))
    bench._check_agreement("exact", "float64", reference.copy(), reference)
    with pytest.raises(AssertionError, match="off by a little"):
        bench._check_agreement("off by a little", "float64", reference + 1e-6, reference)


def test_shape_checks_every_implementation_against_the_reference(monkeypatch):
    correct = bench._numpy_forwards

    def broken(layer, layer32):
        impls = correct(layer, layer32)
        fn, kind, full = impls[("chunked", "float64")]
        impls[("chunked", "float64")] = (lambda X: fn(X) * 1.001, kind, full)
        return impls

    monkeypatch.setattr(bench, "_numpy_forwards", broken)
    with pytest.raises(AssertionError, match="chunked"):
        bench._Shape(1, 16, 32, 4).forwards()


@pytest.mark.parametrize("grid, statistic", [({}, "median"), ({"statistic": "min"}, "min")])
def test_times_are_medians_unless_the_grid_asks_for_the_fastest(monkeypatch, grid, statistic):
    asked = []

    def record(calls, repeat, warmup, statistic):
        asked.append(statistic)
        return dict.fromkeys(calls, 1e-3)

    monkeypatch.setattr(bench, "interleaved_times", record)
    tiny = {**TINY, "lengths": (16,), "heads": (2,), "gemm_n": 8, **grid}
    run_suite(sections=("forward",), grid=tiny, progress=False)
    assert asked == [statistic]


def test_unknown_section_is_rejected():
    with pytest.raises(ValueError, match="unknown sections"):
        run_suite(sections=("forward", "speed"), progress=False)


def test_markdown_and_json(results, tmp_path):
    md = results.to_markdown()
    assert "### Targets" in md and "numpy fused / torch SDPA" in md and "torch nn.MultiheadAttention" in md
    results.to_json(tmp_path / "bench.json")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == len(results.rows)
    assert {"machine", "config", "ratios", "exponents"} <= set(data)


def test_figures_have_log_axes_and_units(results):
    for make, section, key in ((time_vs_length, "forward", "seconds"), (memory_vs_length, "memory", "peak_bytes")):
        ax = make(results).axes[0]
        assert ax.get_xscale() == ax.get_yscale() == "log"
        assert "(tokens)" in ax.get_xlabel() and ("(ms)" in ax.get_ylabel() or "(MiB)" in ax.get_ylabel())
        shown = {(r["impl"], r["dtype"]) for r in results.select(section=section, h=bench.TARGET_H) if r[key]}
        assert len(ax.get_lines()) == len(shown) >= len(FORWARD_IMPLS) - 1  # one line each (a zero is not drawn)
    fig = implementations_bar(json.loads(json.dumps(results.to_dict())))  # from a JSON dict too
    assert isinstance(fig, Figure) and fig.axes[0].get_xscale() == "log" and "ms" in fig.axes[0].get_xlabel()
    with pytest.raises(ValueError, match="h=3"):
        time_vs_length(results, h=3)


def test_times_within_one_decade_are_drawn_with_readable_ticks():
    """A quick run's times may all lie between 0.73 and 1.7 ms: the default log axis then labels too few ticks to
    read (or, on other spans, its crowded minor ticks), which the style check refuses."""
    rows = [{"section": "forward", "h": bench.TARGET_H, "impl": impl, "dtype": "float64", "B": 1, "d_model": 32,
             "L": L, "seconds": s * 1e-3} for impl, times in (("a", (0.73, 0.9, 1.2)), ("b", (0.8, 1.3, 1.7)))
            for L, s in zip((16, 32, 48), times, strict=True)]
    ax = time_vs_length({"rows": rows}).axes[0]
    assert ax.get_yscale() == "log" and len(ax.get_lines()) == 2


def test_cli_writes_table_json_and_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_grid", lambda quick: dict(TINY, heads=(bench.TARGET_H,)))
    assert cli_main(["bench", "--out", str(tmp_path), "--no-progress"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"bench.json", "bench.md", "time_vs_length.png", "memory_vs_length.png",
                     "implementations_bar.png"}
    assert "### Targets" in capsys.readouterr().out


def test_cli_draws_only_the_figures_of_the_sections_it_measured(tmp_path, monkeypatch, capsys):
    """``--sections gemm forward`` has no memory rows: the memory figure is left out, not an error after the
    tables (the bug: every run without the memory section ended in "no memory measurements" and exit 1)."""
    monkeypatch.setattr(bench, "_grid", lambda quick: dict(TINY, heads=(bench.TARGET_H,)))
    assert cli_main(["bench", "--out", str(tmp_path), "--no-progress", "--sections", "gemm", "forward"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"bench.json", "bench.md", "time_vs_length.png",
                                                    "implementations_bar.png"}
    assert "memory_vs_length" not in capsys.readouterr().out


def test_cli_gpu_without_cuda_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "--gpu", "--quick"]) == 1
    assert "CUDA" in capsys.readouterr().err


def test_cli_without_a_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main([])
    assert exit_.value.code == 2
    assert "python -m mha_lab" in capsys.readouterr().err
