"""Context-parallel attention on real processes (gloo, CPU): ring attention and Ulysses equal one device,
forward and backward, and send the formula's bytes.

Four ranks are forked once for the module. Four-rank cases run on the whole world, two-rank cases
on the pairs {0, 1} and {2, 3} (the ``group`` argument); then the refusals and the timing rows.
Every test carries a wall-clock timeout: a deadlock fails, it does not hang.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from mha_lab.parallel import context_check as cp_check  # noqa: E402
from mha_lab.parallel.context import block_attention, block_attention_backward, ulysses_attention  # noqa: E402
from mha_lab.parallel.context_check import Case, check_case, format_report  # noqa: E402
from mha_lab.parallel.launch import spawn  # noqa: E402
from mha_lab.parallel.scaling import context_scaling_worker  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CASES_4 = {f"{mode}{' causal' if causal else ''}": Case(mode=mode, causal=causal, seq_len=24, batch=3, heads=4,
                                                         head_dim=6)
           for mode in ("ring", "ulysses") for causal in (False, True)}
CASES_4["ring gqa causal"] = Case(mode="ring", causal=True, seq_len=16, heads=4, kv_heads=1, head_dim=5)
CASES_4["contiguous split, zigzag schedule"] = Case(mode="ring", causal=True, seq_len=16, contiguous_split=True)
CASES_2 = {"ulysses gqa causal": Case(mode="ulysses", causal=True, seq_len=10, heads=4, kv_heads=2, head_dim=3),
           "ring L=2 causal": Case(mode="ring", causal=True, batch=1, seq_len=4, heads=2, head_dim=4),
           "ring float32": Case(mode="ring", seq_len=14, dtype="float32")}
SCALING = [Case(mode=m, causal=True, batch=1, seq_len=32, heads=4, head_dim=8, dtype="float32")
           for m in ("ring", "ulysses")]


def _worker(device) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    pair = pairs[dist.get_rank() // 2]
    two = {name: check_case(c, device, pair) for name, c in CASES_2.items()}
    four = {name: check_case(c, device) for name, c in CASES_4.items()}
    try:  # 4 heads of q, 2 of k/v on 4 ranks: refused on every rank before any all-to-all
        ulysses_attention(*(torch.zeros(1, h, 2, 3) for h in (4, 2, 2)))
        refused = ""
    except ValueError as err:
        refused = str(err)
    ones = torch.ones(2)
    dist.all_reduce(ones)  # no rank is stuck in a half-started collective
    scaling = context_scaling_worker(device, SCALING, (1, 2, 4), repeat=1)
    return {"two": two, "four": four, "refused": refused, "after": ones.tolist(), "scaling": scaling}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_worker, 4, timeout=150, device="cpu", start_method="fork")


def _reports(ranks, n):
    key, cases, holders = ("two", CASES_2, (0, 2)) if n == 2 else ("four", CASES_4, (0,))
    return [(name, c, ranks[r][key][name]) for r in holders for name, c in cases.items()]


@pytest.mark.parametrize("n", [2, 4])
def test_output_and_gradients_equal_one_device(ranks, n):
    for name, case, r in _reports(ranks, n):
        if case.contiguous_split:
            continue
        assert r["world_size"] == n and r["backend"] == "gloo", name
        assert set(r["diffs"]) == {"output", "grad_q", "grad_k", "grad_v"}
        assert all(r["close"].values()) and r["ok"], (name, r["diffs"])
        assert max(r["diffs"].values()) < (1e-5 if case.dtype == "float32" else 1e-12), (name, r["diffs"])


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_sent_equal_the_formula(ranks, n):
    for name, case, r in _reports(ranks, n):
        kv, e = case.kv_heads or case.heads, 8 if case.dtype == "float64" else 4
        if case.mode == "ring":
            block = 2 * case.batch * kv * case.seq_len // n * case.head_dim * e
            assert r["bytes"] == {"K/V forward": (n - 1) * block, "K/V backward": (n - 1) * block,
                                  "dK/dV backward": n * block}, name
            assert r["calls"] == {"K/V forward": n - 1, "K/V backward": n - 1, "dK/dV backward": n}, name
        else:
            sent = case.batch * case.seq_len // n * case.head_dim * (2 * case.heads + 2 * kv) * (n - 1) // n * e
            assert r["bytes"] == {"all-to-all forward": sent, "all-to-all backward": sent}, name
            assert r["calls"] == {"all-to-all forward": 4, "all-to-all backward": 4}, name
        assert r["bytes"] == r["formula"] and r["bytes_equal_on_ranks"], name


def test_the_zigzag_schedule_on_a_contiguous_split_fails_the_comparison(ranks):
    r = ranks[0]["four"]["contiguous split, zigzag schedule"]
    assert not r["ok"] and not r["close"]["output"] and r["diffs"]["output"] > 1e-2
    text = format_report(r)
    assert "MISMATCH" in text and text.splitlines()[-1].strip() == "FAILED"


def test_only_group_rank_zero_reports(ranks):
    assert [r["two"]["ring float32"] is None for r in ranks] == [False, True, False, True]
    assert [r["four"]["ring"] is None for r in ranks] == [False, True, True, True]


def test_ulysses_refuses_heads_that_do_not_divide_before_any_collective(ranks):
    for r in ranks:
        assert r["refused"].startswith("Ulysses needs num_kv_heads divisible by the world size: num_kv_heads=2, "
                                       "world_size=4")
        assert r["after"] == [4.0, 4.0]


def test_scaling_rows_time_each_mode_on_each_rank_count(ranks):
    rows = ranks[0]["scaling"]
    assert [(r["mode"], r["world_size"]) for r in rows] == [(m, n) for m in ("ring", "ulysses") for n in (1, 2, 4)]
    assert ranks[1]["scaling"] is None
    for r in rows:
        assert r["seconds"] > 0 and 0 <= r["comm_share"] <= 1
        assert (sum(r["bytes"].values()) == 0) == (r["world_size"] == 1), r
    ring4 = next(r for r in rows if r["mode"] == "ring" and r["world_size"] == 4)
    assert ring4["bytes"]["dK/dV backward"] == 4 * 2 * 1 * 4 * 8 * 8 * 4  # N blocks: 2 B h_kv (L/N) d, float32


def test_bench_reports_the_context_parallel_rows(ranks, monkeypatch):
    from mha_lab import bench
    from mha_lab.parallel import scaling

    monkeypatch.setattr(scaling, "measure_context_scaling", lambda cases, ranks_, repeat: ranks[0]["scaling"])
    rows = bench._cp_rows(1, 32, 32, (1, 2, 4), 1)
    assert [(r["mode"], r["ranks"]) for r in rows] == [(m, n) for m in ("ring", "ulysses") for n in (1, 2, 4)]
    text = bench.BenchResults(rows=rows).to_markdown()
    assert "### Context parallelism on CPU ranks" in text and "| ulysses | 4 | " in text


def test_cli_exits_nonzero_on_a_mismatch(ranks, monkeypatch, capsys):
    for names, status in ((["ring", "ring causal"], 0), (["ring", "contiguous split, zigzag schedule"], 1)):
        reports = [ranks[0]["four"][n] for n in names]
        monkeypatch.setattr(cp_check, "spawn", lambda fn, n, args, reports=reports, **kw: [reports])
        assert cp_check.main(["--world-size", "4", "--mode", "ring", "--seq-len", "24"]) == status
        out = capsys.readouterr().out
        assert out.splitlines()[-1].startswith("OK: 2 of 2" if status == 0 else "FAILED: 1 of 2")


@pytest.mark.parametrize(("argv", "message"), [
    (["--world-size", "4", "--mode", "ulysses", "--heads", "6"], "Ulysses needs num_heads divisible"),
    (["--world-size", "4", "--mode", "ring", "--seq-len", "36", "--mask", "causal"],
     "seq_len=36 does not split into 8 equal chunks on 4 ranks (causal ring attention"),
    (["--heads", "8", "--kv-heads", "3"], "heads=8 is not a multiple of kv_heads=3"),
])
def test_cli_refuses_a_bad_case_before_starting_any_rank(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(cp_check, "spawn", lambda *a, **kw: pytest.fail("ranks were started"))
    with pytest.raises(SystemExit) as exit_:
        cp_check.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_cpu_block_equals_the_written_out_one(causal, monkeypatch):
    from mha_lab.parallel import context

    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 3, 6, 5, generator=gen, dtype=torch.float64) for _ in range(4))
    fused = block_attention(q, k, v, 0.3, causal)
    grads = block_attention_backward(dout, fused[0], q, k, v, fused[1], 0.3, causal)
    monkeypatch.setattr(context, "_fused_cpu", lambda q: False)
    written = block_attention(q, k, v, 0.3, causal)
    for a, b in zip((*fused, *grads),
                    (*written, *block_attention_backward(dout, written[0], q, k, v, written[1], 0.3, causal)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    qa = q.clone().requires_grad_()
    ka, va = k.clone().requires_grad_(), v.clone().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=causal, scale=0.3)
    ref.backward(dout)
    torch.testing.assert_close(written[0], ref.detach(), rtol=1e-10, atol=1e-12)
    for g, r in zip(block_attention_backward(dout, written[0], q, k, v, written[1], 0.3, causal),
                    (qa.grad, ka.grad, va.grad), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_the_world_size_is_torchruns_when_it_started_the_process(monkeypatch, capsys):
    import argparse

    from mha_lab.parallel.launch import add_launch_arguments, launch_world_size

    parser = argparse.ArgumentParser(prog="cmd")
    add_launch_arguments(parser)
    assert launch_world_size(parser, parser.parse_args([]), []) == 2  # spawned: the option's default
    with pytest.raises(SystemExit):
        launch_world_size(parser, parser.parse_args(["--world-size", "0"]), ["--world-size", "0"])
    assert "--world-size must be at least 1, got 0" in capsys.readouterr().err
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert launch_world_size(parser, parser.parse_args([]), []) == 3
    with pytest.raises(SystemExit):
        launch_world_size(parser, parser.parse_args(["--world-size", "2"]), ["--world-size", "2"])
    assert "--world-size 2 but torchrun started 3 ranks" in capsys.readouterr().err
