"""Run context-parallel attention on real ranks and compare it with one device: ``python -m mha_lab cp``.

Every rank draws the same whole-sequence Q, K, V and output gradient (same seed), keeps its
block of the sequence (the zigzag split for causal ring attention, contiguous otherwise), runs
ring attention or Ulysses forward and backward, and sends its output, its gradients and its log
of what it sent to rank 0. Rank 0 puts the blocks back in sequence order and reports the largest
difference from PyTorch's attention on the whole sequence, and the bytes each rank sent next to
``ring_bytes`` and ``ulysses_bytes``.

    python -m mha_lab cp --world-size 4
    python -m mha_lab cp --world-size 2 --mode ulysses --heads 8 --kv-heads 2 --mask causal
    torchrun --standalone --nproc-per-node 4 -m mha_lab cp
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mha_lab.parallel.check import bytes_per_rank
from mha_lab.parallel.context import check_heads, ring_attention, ulysses_attention
from mha_lab.parallel.cost import ring_bytes, ulysses_bytes
from mha_lab.parallel.launch import add_launch_arguments, init_from_env, launch_world_size, spawn, under_torchrun
from mha_lab.parallel.layer import CommLog
from mha_lab.parallel.sequence import shard_sequence, unshard_sequence
from mha_lab.testing import tolerances

__all__ = ["Case", "inputs", "rank_inputs", "check_case", "check_worker", "format_report", "validate", "main"]

MODES = {"ring": ring_attention, "ulysses": ulysses_attention}


@dataclass(frozen=True)
class Case:
    """One attention call to check. ``contiguous_split``: causal ring attention fed a contiguous split
    instead of the zigzag one its schedule assumes, a fault the comparison must catch."""

    mode: str = "ring"
    causal: bool = False
    batch: int = 2
    seq_len: int = 64
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 16
    dtype: str = "float64"
    seed: int = 0
    contiguous_split: bool = False

    @property
    def zigzag(self) -> bool:
        return self.mode == "ring" and self.causal and not self.contiguous_split


def validate(case: Case, world_size: int) -> None:
    """Refuse a case that cannot run on ``world_size`` ranks, before any rank starts."""
    if case.mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {case.mode!r}")
    kv = case.kv_heads or case.heads
    if case.heads % kv:
        raise ValueError(f"heads={case.heads} is not a multiple of kv_heads={kv}")
    parts = 2 * world_size if case.mode == "ring" and case.causal else world_size
    if case.seq_len % parts:
        raise ValueError(f"seq_len={case.seq_len} does not split into {parts} equal chunks on {world_size} ranks"
                         + (" (causal ring attention: two zigzag chunks per rank)" if parts > world_size else ""))
    if case.mode == "ulysses":
        check_heads(case.heads, kv, world_size)


def inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q (B, h, L, d), k, v (B, h_kv, L, d) and output gradient: equal on every rank."""
    gen, dtype = torch.Generator().manual_seed(case.seed), getattr(torch, case.dtype)
    kv = case.kv_heads or case.heads
    shapes = [(case.batch, h, case.seq_len, case.head_dim) for h in (case.heads, kv, kv, case.heads)]
    return tuple(torch.randn(s, generator=gen, dtype=dtype) for s in shapes)


def rank_inputs(case: Case, device: torch.device, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """This rank's block of ``inputs(case)``, on ``device``: q, k, v (requiring gradients) and the output gradient."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, grad_out = (torch.from_numpy(shard_sequence(t.numpy(), n, case.zigzag)[rank]).to(device)
                         for t in inputs(case))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def _formula(case: Case, world_size: int) -> dict[str, int]:
    kv = case.kv_heads or case.heads
    if case.mode == "ring":
        return ring_bytes(case.batch, case.seq_len, kv, case.head_dim, world_size, case.dtype)
    return ulysses_bytes(case.batch, case.seq_len, case.heads, kv, case.head_dim, world_size, case.dtype)


def check_case(case: Case, device: torch.device, group: dist.ProcessGroup | None = None) -> dict | None:
    """Forward and backward of this rank's block; rank 0 gets the report, the others None. Collective."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, grad_out = rank_inputs(case, device, group)
    log = CommLog()
    out = MODES[case.mode](q, k, v, case.causal, group, log)
    out.backward(grad_out)
    shard = {name: t.detach().cpu().numpy() for name, t in
             (("output", out), ("grad_q", q.grad), ("grad_k", k.grad), ("grad_v", v.grad))}
    shard["comm"] = log.records
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(shard, gathered, group=group, group_dst=0)
    return _report(case, n, dist.get_backend(group), device, gathered) if rank == 0 else None


def _report(case: Case, n: int, backend: str, device, shards: list[dict]) -> dict:
    """Largest differences from one device, bytes per rank against the formula, judged."""
    q, k, v, grad_out = (t.requires_grad_() if i < 3 else t for i, t in enumerate(inputs(case)))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=q.shape[1] != k.shape[1])
    ref.backward(grad_out)
    want = {"output": ref, "grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
    tol = tolerances(case.dtype)
    diffs, close = {}, {}
    for name, w in want.items():
        got = unshard_sequence([s[name] for s in shards], case.zigzag)  # the order the ranks' blocks were cut in
        diffs[name] = float(np.abs(got - w.detach().numpy()).max())
        close[name] = bool(np.allclose(got, w.detach().numpy(), **tol))
    formula = _formula(case, n)
    sent = bytes_per_rank(shards, formula)
    return {"case": asdict(case), "world_size": n, "backend": backend, "device": str(device), "diffs": diffs,
            "close": close, **sent, "formula": formula, "ok": all(close.values()) and sent["bytes"] == formula}


def check_worker(device: torch.device, cases: list[Case]) -> list[dict | None]:
    """``spawn`` target: check every case in turn on one process group."""
    return [check_case(c, device) for c in cases]


def format_report(r: dict) -> str:
    """One case as the terminal shows it: differences, then bytes per rank against the formula."""
    c = r["case"]
    kv = c["kv_heads"] or c["heads"]
    split = "zigzag split" if c["mode"] == "ring" and c["causal"] and not c["contiguous_split"] else "contiguous split"
    lines = [f"{c['mode']} attention on {r['world_size']} ranks ({r['backend']}, {r['device']}, {c['dtype']}): "
             f"B={c['batch']}, L={c['seq_len']}, {c['heads']} heads, {kv} K/V heads, d_k={c['head_dim']}, "
             f"{'causal, ' if c['causal'] else ''}{split}",
             "  largest |difference| from one device:  " + "  ".join(
                 f"{name} {gap:.1e} {'ok' if r['close'][name] else 'MISMATCH'}" for name, gap in r["diffs"].items())]
    for op, formula in r["formula"].items():
        lines.append(f"  bytes sent per rank, {op:<20} {r['calls'][op]} call(s) {r['bytes'][op]:>10,} / formula "
                     f"{formula:>10,}  {'ok' if r['bytes'][op] == formula else 'MISMATCH'}")
    lines.append(f"  {'OK' if r['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Spawn the ranks (or join torchrun's), check every chosen case, print rank 0's reports; 1 on a mismatch."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab cp", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ring", "ulysses", "both"), default="both")
    parser.add_argument("--mask", choices=("none", "causal", "both"), default="both")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: as many as --heads (MHA); 1 is MQA")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    add_launch_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torchrun, world_size = under_torchrun(), launch_world_size(parser, args, argv)
    cases = [Case(mode, causal, args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim, args.dtype,
                  args.seed)
             for mode in (("ring", "ulysses") if args.mode == "both" else (args.mode,))
             for causal in ((False, True) if args.mask == "both" else (args.mask == "causal",))]
    try:  # refuse a bad case here, before any rank starts
        for case in cases:
            validate(case, world_size)
    except ValueError as err:
        parser.error(str(err))
    if torchrun:
        reports = check_worker(init_from_env(args.device, args.timeout), cases)
        dist.destroy_process_group()
    else:
        reports = spawn(check_worker, world_size, (cases,), timeout=args.timeout, device=args.device)[0]
    if reports[0] is None:  # a torchrun rank other than 0: rank 0 speaks for the job
        return 0
    print("\n".join(format_report(r) for r in reports))
    failed = sum(not r["ok"] for r in reports)
    print(f"{'OK' if not failed else 'FAILED'}: {len(reports) - failed} of {len(reports)} cases equal one device "
          f"forward and backward (rtol {tolerances(args.dtype)['rtol']:g}, atol {tolerances(args.dtype)['atol']:g}) "
          "with the formula's bytes")
    return 1 if failed else 0
