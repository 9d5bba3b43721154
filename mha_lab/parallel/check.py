"""Run the tensor-parallel layer on real ranks and compare it with one device: ``python -m mha_lab tp``.

Every rank builds the same single-device ``MultiHeadAttention`` (same seed), takes its shard,
runs forward and backward on the same input, and sends its output, input gradient, shard
gradients and all-reduce log to rank 0. Rank 0 puts the shards back where ``shard_index``
says they came from and reports the largest difference from the single-device layer for
the output and for every gradient, and the bytes each rank handed to the all-reduces next to
``allreduce_bytes`` and ``kv_grad_allreduce_bytes``.

    python -m mha_lab tp --world-size 2 --heads 8 --kv-heads 2 --seq-len 64 --causal
    torchrun --standalone --nproc-per-node 2 -m mha_lab tp --heads 8 --kv-heads 2 --causal
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from mha_lab.cuda.attention import MultiHeadAttention
from mha_lab.parallel.cost import allreduce_bytes, kv_grad_allreduce_bytes
from mha_lab.parallel.heads import check_split, head_columns, rank_heads
from mha_lab.parallel.launch import add_launch_arguments, init_from_env, launch_world_size, spawn, under_torchrun
from mha_lab.parallel.layer import TensorParallelAttention
from mha_lab.testing import tolerances

__all__ = ["Case", "reference", "check_case", "check_worker", "bytes_per_rank", "format_report", "main"]

OPS = ("g forward", "f backward", "K/V grads backward")


@dataclass(frozen=True)
class Case:
    """One layer and input to check. ``wrong_shard_rank``: that rank loads the next rank's W_O rows."""

    batch: int = 2
    seq_len: int = 64
    d_model: int = 64
    heads: int = 8
    kv_heads: int | None = None
    causal: bool = False
    bias: bool = True
    dtype: str = "float64"
    seed: int = 0
    wrong_shard_rank: int | None = None


def reference(case: Case, device: torch.device) -> tuple[MultiHeadAttention, torch.Tensor, torch.Tensor]:
    """The single-device layer (nonzero biases), the input and the output gradient: equal on every rank."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    layer = MultiHeadAttention(case.d_model, case.heads, case.kv_heads, causal=case.causal, bias=case.bias,
                               dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():  # the same values on every rank, whatever its global RNG did
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / case.d_model**0.5)
    x = torch.randn(case.batch, case.seq_len, case.d_model, generator=gen, dtype=dtype)
    grad_out = torch.randn(x.shape, generator=gen, dtype=dtype)
    return layer.to(device), x.to(device), grad_out.to(device)


def _wrong_shard(tp: TensorParallelAttention, layer: MultiHeadAttention) -> None:
    """Give ``tp`` the W_O rows of the next rank's heads: a fault the comparison must catch."""
    other, _ = rank_heads(tp.num_heads, tp.num_kv_heads, tp.world_size, (tp.rank + 1) % tp.world_size)
    with torch.no_grad():
        tp.W_O.copy_(layer.W_O[head_columns(other, tp.d_k)])


def check_case(case: Case, device: torch.device, group: dist.ProcessGroup | None = None) -> dict | None:
    """Forward and backward on every rank of ``group``; rank 0 gets the report, the other ranks None. Collective."""
    layer, x, grad_out = reference(case, device)
    tp = TensorParallelAttention(layer, group)
    if case.wrong_shard_rank == tp.rank:
        _wrong_shard(tp, layer)
    x_tp = x.clone().requires_grad_()
    out = tp(x_tp)
    out.backward(grad_out)
    shard = {"output": out.detach().cpu(), "grad_X": x_tp.grad.cpu(), "comm": tp.comm.records,
             "grads": {n: (index, getattr(tp, n).grad.cpu()) for n, index in tp.shard_index().items()
                       if getattr(tp, n) is not None}}
    gathered = [None] * tp.world_size if tp.rank == 0 else None
    dist.gather_object(shard, gathered, group=group, group_dst=0)
    if tp.rank != 0:
        return None
    x_ref = x.clone().requires_grad_()
    ref_out = layer(x_ref)
    ref_out.backward(grad_out)
    return _report(case, tp, dist.get_backend(group), device, gathered,
                   {"output": ref_out.detach().cpu(), "grad_X": x_ref.grad.cpu(),
                    **{n: p.grad.cpu() for n, p in layer.named_parameters()}})


def _report(case: Case, tp: TensorParallelAttention, backend: str, device, shards: list[dict],
            ref: dict[str, torch.Tensor]) -> dict:
    """Largest differences (the shards put back in place), bytes per rank and the formulas, judged."""
    tol = tolerances(case.dtype)
    diffs, close = {}, {}

    def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        gap = (got - want).abs().nan_to_num(nan=float("inf")).max().item()  # NaN: a slice no rank holds
        diffs[name] = max(diffs.get(name, 0.0), gap)
        close[name] = close.get(name, True) and torch.allclose(got, want, **tol)

    for s in shards:  # replicated tensors: every rank's copy must match
        compare("output", s["output"], ref["output"])
        compare("grad_X", s["grad_X"], ref["grad_X"])
    for name in shards[0]["grads"]:
        full = torch.full_like(ref[name], float("nan"))
        for s in shards:
            index, grad = s["grads"][name]
            compare(f"grad_{name}", grad, ref[name][index])
            full[index] = grad
        compare(f"grad_{name}", full, ref[name])  # the shards tile the whole gradient
    message = allreduce_bytes(case.batch, case.seq_len, case.d_model, tp.world_size, case.dtype)
    formula = {"g forward": message["message"], "f backward": message["message"],
               "K/V grads backward": kv_grad_allreduce_bytes(case.d_model, case.heads, tp.num_kv_heads,
                                                             tp.world_size, case.bias, case.dtype)}
    sent = bytes_per_rank(shards, OPS)
    return {"case": asdict(case), "world_size": tp.world_size, "backend": backend, "device": str(device),
            "kv_split": tp.num_kv_heads >= tp.world_size, "diffs": diffs, "close": close, **sent,
            "formula": formula, "ring_per_rank": message["ring_per_device"],
            "ok": all(close.values()) and sent["bytes"] == formula}


def bytes_per_rank(shards: list[dict], ops) -> dict:
    """From every rank's ``comm`` log: the most bytes any rank sent per op, whether all ranks sent the same,
    and rank 0's number of calls per op."""
    per_rank = [{op: sum(r["bytes"] for r in s["comm"] if r["op"] == op) for op in ops} for s in shards]
    return {"bytes": {op: max(b[op] for b in per_rank) for op in ops},
            "bytes_equal_on_ranks": all(b == per_rank[0] for b in per_rank),
            "calls": {op: sum(r["op"] == op for r in shards[0]["comm"]) for op in ops}}


def check_worker(device: torch.device, cases: list[Case]) -> list[dict | None]:
    """``spawn`` target: check every case in turn (one process group for all of them)."""
    return [check_case(c, device) for c in cases]


def format_report(r: dict) -> str:
    """The report as the terminal shows it: differences, then bytes per rank against the formula."""
    c = r["case"]
    kv = c["kv_heads"] or c["heads"]
    kind = "MHA" if kv == c["heads"] else "MQA" if kv == 1 else "GQA"
    how = kind if kind == "MHA" else f"{kind}, K/V heads {'split' if r['kv_split'] else 'replicated'}"
    lines = [f"tensor-parallel attention on {r['world_size']} ranks ({r['backend']}, {r['device']}, {c['dtype']}): "
             f"B={c['batch']}, L={c['seq_len']}, d_model={c['d_model']}, {c['heads']} heads, {kv} K/V heads ({how})"
             f"{', causal' if c['causal'] else ''}{', bias' if c['bias'] else ''}",
             "largest |difference| from the single-device layer (forward, then backward):"]
    lines += [f"  {name:<10} {gap:9.1e}  {'ok' if r['close'][name] else 'MISMATCH'}"
              for name, gap in r["diffs"].items()]
    lines.append("bytes handed to the all-reduces per rank and step (measured / formula):")
    for op in OPS:
        lines.append(f"  {op:<19} {r['calls'][op]} call(s)  {r['bytes'][op]:>10,} / {r['formula'][op]:>10,}  "
                     f"{'ok' if r['bytes'][op] == r['formula'][op] else 'MISMATCH'}")
    lines.append(f"  a ring all-reduce of the {r['formula']['g forward']:,}-byte activation sends "
                 f"2(N-1)/N of it: {r['ring_per_rank']:,.0f} bytes per rank")
    tol = tolerances(c["dtype"])
    equal = "equal" if all(r["close"].values()) else "do NOT equal"
    counted = "the formula's" if r["bytes"] == r["formula"] else "NOT the formula's"
    lines.append(f"{'OK' if r['ok'] else 'FAILED'}: output and gradients {equal} one device's "
                 f"(rtol {tol['rtol']:g}, atol {tol['atol']:g}); bytes are {counted}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Spawn the ranks (or join torchrun's), check one case, print rank 0's report; 1 on a mismatch."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab tp", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: as many as --heads (MHA); 1 is MQA")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--no-bias", action="store_true")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    add_launch_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torchrun, world_size = under_torchrun(), launch_world_size(parser, args, argv)
    case = Case(args.batch, args.seq_len, args.d_model, args.heads, args.kv_heads, args.causal,
                not args.no_bias, args.dtype, args.seed)
    try:  # refuse a bad layer or split here, before any rank starts
        MultiHeadAttention(case.d_model, case.heads, case.kv_heads)
        check_split(case.heads, case.kv_heads or case.heads, world_size)
    except ValueError as err:
        parser.error(str(err))
    if torchrun:
        report = check_worker(init_from_env(args.device, args.timeout), [case])[0]
        dist.destroy_process_group()
    else:
        report = spawn(check_worker, args.world_size, ([case],), timeout=args.timeout, device=args.device)[0][0]
    if report is None:  # a torchrun rank other than 0: rank 0 speaks for the job
        return 0
    print(format_report(report))
    return 0 if report["ok"] else 1
