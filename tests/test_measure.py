"""Measurement: interleaved timing, peak memory of NumPy and torch, growth exponents, thread control."""

import subprocess
import sys

import numpy as np
import pytest

from mha_lab.measure import (
    blas_threads,
    fastest_runs,
    fit_exponent,
    gemm_flops_per_second,
    interleaved_times,
    median_time,
    read_bytes_per_second,
    torch_peak_memory,
    traced_memory,
)


def test_interleaved_times_runs_the_candidates_round_robin():
    order = []
    times = interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeat=3, warmup=1)
    assert order == ["a", "b"] * 4 and set(times) == {"a", "b"}


def test_interleaved_times_can_report_the_fastest_run():
    durations = iter([0.0, 0.02, 0.0, 0.0])  # warm-up, then a slow run among fast ones

    def sleepy():
        import time

        time.sleep(next(durations))

    fastest = interleaved_times({"a": sleepy}, repeat=3, warmup=1, statistic="min")["a"]
    assert fastest < 0.01
    with pytest.raises(ValueError, match="statistic"):
        interleaved_times({"a": sleepy}, statistic="mean")


def test_fastest_runs_repeats_the_fastest_of_n_reading():
    """Three readings, each the fastest of two calls (after one warm-up in the first round only): the readings
    are what a fake clock says each round's fastest call took."""
    ticks = iter([0, 5, 5, 7, 7, 11, 11, 14,  # round 1: a takes 5 and 4, b takes 2 and 3
                  20, 26, 26, 27, 27, 29, 29, 33,  # round 2: a 6 and 2, b 1 and 4
                  40, 43, 43, 46, 46, 49, 49, 50])  # round 3: a 3 and 3, b 3 and 1
    calls = []
    readings = fastest_runs({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, runs=3, repeat=2,
                            clock=lambda: next(ticks))
    assert readings == {"a": [4, 2, 3], "b": [2, 1, 1]}
    assert calls == ["a", "b"] * 7  # one warm-up, then two timed calls of each in each of three rounds
    with pytest.raises(ValueError, match="at least 2"):
        fastest_runs({"a": lambda: None}, runs=1)


def test_machine_ceilings_are_positive_rates():
    assert gemm_flops_per_second(n=64, repeat=1) > 0
    assert read_bytes_per_second(n_bytes=2**20, repeat=1) > 0


def test_median_time_runs_warmup_plus_repeats():
    calls = []
    t = median_time(lambda: calls.append(1), repeat=4, warmup=2)
    assert len(calls) == 6 and t >= 0
    with pytest.raises(ValueError, match="repeat"):
        median_time(lambda: None, repeat=0)


def test_peak_memory_sees_numpy_and_torch_buffers():
    n = 2**20  # 8 MiB of float64
    assert traced_memory(lambda: np.ones(n))[1] >= 8 * n
    assert traced_memory(lambda: None)[1] < 8 * n
    torch = pytest.importorskip("torch")
    assert torch_peak_memory(lambda: torch.ones(n, dtype=torch.float64)) >= 8 * n


def test_fit_exponent_recovers_a_power_law():
    L = np.array([128, 256, 1024, 4096])
    assert fit_exponent(L, 3.0 * L**2) == pytest.approx(2.0)
    assert fit_exponent(L, 5.0 * L) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two distinct"):
        fit_exponent([4, 4], [1, 2])
    with pytest.raises(ValueError, match="positive"):
        fit_exponent([1, 2], [0, 1])


def test_blas_threads_are_set_and_read_back():
    before = blas_threads()
    if before is None:
        pytest.skip("NumPy's BLAS is not OpenBLAS here")
    try:
        assert blas_threads(1) == 1
    finally:
        blas_threads(before)


def test_cache_sizes_read_each_data_cache_level(tmp_path):
    from mha_lab.measure import cache_sizes

    reported = [("1", "Data", "48K"), ("1", "Instruction", "64K"), ("2", "Unified", "2048K"), ("3", "Unified", "480M")]
    for i, (level, kind, size) in enumerate(reported):
        index = tmp_path / "cache" / f"index{i}"
        index.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(text + "\n")
    assert cache_sizes(str(tmp_path)) == {1: 48 * 2**10, 2: 2 * 2**20, 3: 480 * 2**20}
    assert cache_sizes(str(tmp_path / "none")) == {}
    for i, size in enumerate(("", "big"), start=len(reported)):  # sizes that are no number: left out, no error
        index = tmp_path / "cache" / f"index{i}"
        index.mkdir()
        for name, text in (("level", "4"), ("type", "Unified"), ("size", size)):
            (index / name).write_text(text + "\n")
    assert cache_sizes(str(tmp_path)) == {1: 48 * 2**10, 2: 2 * 2**20, 3: 480 * 2**20}


def test_last_level_cache_is_the_largest_reported_cache():
    from mha_lab.measure import last_level_cache_bytes

    size = last_level_cache_bytes()
    assert size is None or size >= 2**16  # no processor this runs on has a last-level cache under 64 KiB


def test_torch_ops_called_names_the_operators_that_ran():
    torch = pytest.importorskip("torch")
    from mha_lab.measure import torch_ops_called

    ops = torch_ops_called(lambda: torch.ones(2, 3) @ torch.ones(3, 2))
    assert "aten::mm" in ops and "aten::repeat_interleave" not in ops
    assert "aten::repeat_interleave" in torch_ops_called(lambda: torch.ones(2).repeat_interleave(2))


def test_the_profiler_measurements_leave_torch_inductor_unimported():
    pytest.importorskip("torch")
    code = ("import sys, torch\n"
            "from mha_lab.measure import torch_ops_called, torch_peak_memory\n"
            "torch_peak_memory(lambda: torch.ones(8)); torch_ops_called(lambda: torch.ones(8))\n"
            "assert 'torch._inductor' not in sys.modules, 'the profiler imported torch._inductor'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_read_matrix_is_twice_the_last_level_cache_within_bounds(monkeypatch):
    from mha_lab import measure

    for llc, expected in [(None, measure.READ_BYTES_MIN), (2**20, measure.READ_BYTES_MIN),
                          (2**28, 2**29), (2**31, measure.READ_BYTES_MAX)]:
        monkeypatch.setattr(measure, "last_level_cache_bytes", lambda llc=llc: llc)
        assert measure.read_matrix_bytes() == expected


def test_usable_cores_counts_the_affinity_mask_not_the_host(monkeypatch):
    import os

    from mha_lab.measure import usable_cores

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores() == 2


def test_the_machine_line_counts_the_usable_cores_as_the_scaling_runs_do(monkeypatch):
    import os

    from mha_lab.measure import machine_info

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert machine_info()["nproc"] == 2


@pytest.mark.parametrize("host, expected", [(64, 64), (None, 1)])
def test_usable_cores_without_an_affinity_mask_is_the_host_count(monkeypatch, host, expected):
    import os

    from mha_lab.measure import usable_cores

    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # as on macOS and Windows
    monkeypatch.setattr(os, "cpu_count", lambda: host)
    assert usable_cores() == expected
