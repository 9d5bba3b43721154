"""The tensor-parallel layer on real processes (gloo, CPU): equal to one device, forward and backward.

Four ranks are started once for the whole module, forked so that they inherit the imported
PyTorch instead of importing it again. Two-rank cases run on the pairs {0, 1} and
{2, 3} (subgroups, so the ``group`` argument is exercised too), four-rank cases on the whole
world, then the refusals. Every test carries a wall-clock timeout: a deadlock fails, it does
not hang.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from mha_lab.cuda import MultiHeadAttention  # noqa: E402
from mha_lab.parallel import allreduce_bytes  # noqa: E402
from mha_lab.parallel import check as tp_check  # noqa: E402
from mha_lab.parallel.check import Case, check_case, format_report  # noqa: E402
from mha_lab.parallel.launch import spawn  # noqa: E402
from mha_lab.parallel.layer import TensorParallelAttention  # noqa: E402
from mha_lab.parallel.scaling import scaling_worker  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CASES_2 = {
    "mha bias": Case(heads=8, bias=True),
    "mha causal, awkward shape": Case(batch=3, seq_len=7, d_model=24, heads=4, causal=True, bias=False),
    "gqa split": Case(heads=8, kv_heads=2, causal=True),
    "mqa": Case(seq_len=33, heads=8, kv_heads=1, causal=True),
    "wrong shard": Case(heads=8, wrong_shard_rank=1),
}
CASES_4 = {
    "mha causal": Case(seq_len=17, heads=8, causal=True),
    "gqa split": Case(heads=8, kv_heads=4),
    "gqa replicated": Case(heads=8, kv_heads=2, causal=True),
    "mqa L=1": Case(seq_len=1, d_model=32, heads=4, kv_heads=1, causal=True),
}

SCALING_CASE = Case(seq_len=16, d_model=32, heads=4, bias=False, dtype="float32")


def _refusals(device) -> dict[str, str]:
    """Bad input on every rank: each must raise before its first collective, leaving the group usable."""
    errors = {}
    try:
        TensorParallelAttention(MultiHeadAttention(24, 6, dtype=torch.float64))
    except ValueError as err:
        errors["heads"] = str(err)
    tp = TensorParallelAttention(MultiHeadAttention(32, 8, dtype=torch.float64))
    try:
        tp(torch.zeros(1, 5, 16, dtype=torch.float64))
    except ValueError as err:
        errors["d_model"] = str(err)
    errors["no collective started"] = str(tp.comm.records == [])
    ones = torch.ones(3)
    dist.all_reduce(ones)  # every rank is here, none is stuck in a half-started collective
    errors["group still works"] = str(ones.tolist())
    return errors


def _worker(device) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    pair = pairs[dist.get_rank() // 2]
    two = {name: check_case(c, device, pair) for name, c in CASES_2.items()}
    four = {name: check_case(c, device) for name, c in CASES_4.items()}
    scaling = scaling_worker(device, SCALING_CASE, (1, 2, 4), repeat=1)
    return {"two": two, "four": four, "refusals": _refusals(device), "scaling": scaling}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_worker, 4, timeout=120, device="cpu", start_method="fork")


def _reports(ranks, n):
    """(name, world size, report) for the cases at ``n`` ranks, from every group's rank 0."""
    key, cases = ("two", CASES_2) if n == 2 else ("four", CASES_4)
    holders = (0, 2) if n == 2 else (0,)
    return [(name, c, ranks[r][key][name]) for r in holders for name, c in cases.items()]


@pytest.mark.parametrize("n", [2, 4])
def test_forward_and_every_gradient_equal_one_device(ranks, n):
    for name, case, r in _reports(ranks, n):
        if case.wrong_shard_rank is not None:
            continue
        assert r["world_size"] == n and r["backend"] == "gloo"
        names = {"output", "grad_X", "grad_W_Q", "grad_W_K", "grad_W_V", "grad_W_O"}
        names |= {"grad_b_Q", "grad_b_K", "grad_b_V", "grad_b_O"} if case.bias else set()
        assert set(r["diffs"]) == names, name
        assert all(r["close"].values()), (name, r["diffs"])
        assert max(r["diffs"].values()) < 1e-12, (name, r["diffs"])
        assert r["ok"], name


def test_only_group_rank_zero_reports(ranks):
    assert [r["two"]["mha bias"] is None for r in ranks] == [False, True, False, True]
    assert [r["four"]["mha causal"] is None for r in ranks] == [False, True, True, True]


@pytest.mark.parametrize("n", [2, 4])
def test_measured_allreduce_bytes_equal_the_formula(ranks, n):
    for name, case, r in _reports(ranks, n):
        message = case.batch * case.seq_len * case.d_model * 8  # float64
        assert message == allreduce_bytes(case.batch, case.seq_len, case.d_model, n, "float64")["message"]
        assert r["calls"]["g forward"] == r["calls"]["f backward"] == 1, name
        assert r["bytes"]["g forward"] == r["bytes"]["f backward"] == message, name
        assert r["bytes_equal_on_ranks"], name
        kv = case.kv_heads or case.heads
        d_k = case.d_model // case.heads
        replicated = kv < n
        assert r["kv_split"] is not replicated
        expected = (2 * case.d_model * d_k + (2 * d_k if case.bias else 0)) * 8 if replicated else 0
        assert r["bytes"]["K/V grads backward"] == expected == r["formula"]["K/V grads backward"], name
        assert r["calls"]["K/V grads backward"] == (4 if case.bias else 2) * replicated, name


def test_a_rank_with_a_wrong_shard_fails_the_comparison(ranks):
    r = ranks[0]["two"]["wrong shard"]
    assert not r["ok"]
    assert not r["close"]["output"] and not r["close"]["grad_X"]
    assert r["diffs"]["output"] > 1e-3
    text = format_report(r)
    assert "MISMATCH" in text and text.splitlines()[-1].startswith("FAILED")


def test_bad_input_is_refused_on_every_rank_before_any_collective(ranks):
    for r in ranks:
        errors = r["refusals"]
        assert errors["heads"].startswith("num_heads=6 is not divisible by world_size=4")
        assert errors["d_model"] == "x has d_model=16 but the layer expects d_model=32"
        assert errors["no collective started"] == "True"
        assert errors["group still works"] == "[4.0, 4.0, 4.0]"


def test_no_process_group_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        TensorParallelAttention(MultiHeadAttention(16, 2))


def test_cli_prints_the_report_and_exits_nonzero_on_a_mismatch(ranks, monkeypatch, capsys):
    """``python -m mha_lab tp``'s exit status follows the report (the spawning itself is the fixture's)."""
    for name, status in (("mha bias", 0), ("wrong shard", 1)):
        report = ranks[0]["two"][name]
        monkeypatch.setattr(tp_check, "spawn", lambda fn, n, args, report=report, **kw: [[report]])
        assert tp_check.main(["--world-size", "2"]) == status
        out = capsys.readouterr().out
        assert out.splitlines()[-1].startswith("OK" if status == 0 else "FAILED")
        assert "65,536 /     65,536" in out


def test_scaling_rows_measure_one_step_per_rank_count(ranks):
    from mha_lab.measure import usable_cores

    rows = ranks[0]["scaling"]
    assert [r["world_size"] for r in rows] == [1, 2, 4] and ranks[1]["scaling"] is None
    c = SCALING_CASE
    message = c.batch * c.seq_len * c.d_model * 4  # float32
    for r in rows:
        assert r["bytes"] == {"g forward": message, "f backward": message, "K/V grads backward": 0}
        assert r["seconds"] > 0 and 0 <= r["allreduce_share"] <= 1
        assert r["ideal_speedup"] == min(r["world_size"], usable_cores())
    assert [rows[0]["flops_per_rank"] / r["flops_per_rank"] for r in rows] == [1, 2, 4]


def test_bench_reports_the_tensor_parallel_rows(ranks, monkeypatch):
    from mha_lab import bench
    from mha_lab.parallel import scaling

    monkeypatch.setattr(scaling, "measure_scaling", lambda case, world_sizes, repeat: ranks[0]["scaling"])
    rows = bench._tp_rows(2, 16, 32, (1, 2, 4), 1)
    assert [r["ranks"] for r in rows] == [1, 2, 4] and {r["section"] for r in rows} == {"tp"}
    text = bench.BenchResults(rows=rows).to_markdown()
    assert "### Tensor parallelism on CPU ranks" in text
    assert "| 4 | " in text and "all-reduce share" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--world-size", "3"], "num_heads=8 is not divisible by world_size=3"),
    (["--d-model", "60"], "d_model=60 is not divisible by num_heads=8"),
    (["--heads", "8", "--kv-heads", "3"], "num_heads=8 is not divisible by num_kv_heads=3"),
])
def test_cli_refuses_a_bad_layer_before_starting_any_rank(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(tp_check, "spawn", lambda *a, **kw: pytest.fail("ranks were started"))
    with pytest.raises(SystemExit) as exit_:
        tp_check.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
