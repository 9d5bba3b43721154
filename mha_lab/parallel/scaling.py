"""One training step of the tensor-parallel layer, or of context-parallel attention, on 1, 2, 4... ranks.

``scaling_worker`` runs on the largest rank count; for each smaller count N the first N ranks
form a group and the others wait. Every rank runs one thread, so N ranks can use at most
``min(N, cores)`` cores, counting the cores this process may run on (``usable_cores``): the ideal
speed-up over one rank. A step is forward and backward;
its time is the median over repeats on the slowest rank, and the all-reduce time is what that
rank spent inside the collectives (waiting for the other ranks included). ``measure_scaling``
starts the ranks and returns the rows. ``context_scaling_worker`` and ``measure_context_scaling`` do the
same for ring attention and Ulysses (``mha_lab.parallel.context``): their communication time is what a
rank spent starting and waiting for its transfers, the part that the compute did not hide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import median

import torch
import torch.distributed as dist

from mha_lab.analysis import count_backward_flops, count_flops
from mha_lab.measure import median_time, usable_cores
from mha_lab.parallel.check import OPS, Case, reference
from mha_lab.parallel.context_check import MODES, rank_inputs
from mha_lab.parallel.context_check import Case as CpCase
from mha_lab.parallel.launch import spawn
from mha_lab.parallel.layer import CommLog, TensorParallelAttention

__all__ = ["step_seconds", "scaling_worker", "measure_scaling", "context_step_seconds", "context_scaling_worker",
           "measure_context_scaling"]


def step_seconds(case: Case, device: torch.device, group: dist.ProcessGroup | None, repeat: int = 5) -> dict:
    """This rank's median step time, the all-reduce part of it, and the bytes it handed in. Collective."""
    layer, x, grad_out = reference(case, device)
    tp = TensorParallelAttention(layer, group)
    x = x.requires_grad_()
    comm_seconds: list[float] = []

    def step() -> None:
        dist.barrier(group)  # every rank starts the step together
        tp.comm.clear()
        tp.zero_grad(set_to_none=True)
        tp(x).backward(grad_out)
        comm_seconds.append(tp.comm.total("seconds"))

    seconds = median_time(step, repeat=repeat, warmup=1)
    return {"seconds": seconds, "allreduce_seconds": median(comm_seconds[1:]),
            "bytes": {op: int(tp.comm.total("bytes", op)) for op in OPS}}


def _over_rank_counts(world_sizes: Sequence[int], step: Callable[[dist.ProcessGroup], dict], flops: float,
                      comm_key: str, share_key: str) -> list[dict] | None:
    """On the first n ranks for each n: ``step(group)`` on each, the slowest rank's row on rank 0. Collective."""
    rank, rows, cores = dist.get_rank(), [], usable_cores()
    for n in world_sizes:
        group = dist.new_group(list(range(n)))  # collective: every rank of the job creates every group
        if rank < n:
            mine = step(group)
            ranks = [None] * n if rank == 0 else None
            dist.gather_object(mine, ranks, group=group, group_dst=0)
            if rank == 0:
                slowest = max(ranks, key=lambda r: r["seconds"])
                rows.append({"world_size": n, "ideal_speedup": min(n, cores), **slowest,
                             "flops_per_rank": flops / n, share_key: slowest[comm_key] / slowest["seconds"]})
        dist.barrier()
    return rows if rank == 0 else None


def scaling_worker(device: torch.device, case: Case, world_sizes: Sequence[int], repeat: int = 5) -> list[dict] | None:
    """``spawn`` target on ``max(world_sizes)`` ranks; rank 0 returns one row per rank count."""
    torch.set_num_threads(1)  # one core per rank: more threads would compete with the other ranks
    h_kv = case.kv_heads or case.heads
    flops = count_flops(case.batch, case.seq_len, case.d_model, case.heads, h_kv, causal=case.causal) \
        + count_backward_flops(case.batch, case.seq_len, case.d_model, case.heads, h_kv, causal=case.causal)
    return _over_rank_counts(world_sizes, lambda group: step_seconds(case, device, group, repeat), flops,
                             "allreduce_seconds", "allreduce_share")


def context_step_seconds(case: CpCase, device: torch.device, group: dist.ProcessGroup | None,
                         repeat: int = 5) -> dict:
    """This rank's median time of ring or Ulysses attention forward and backward on its block, the time spent
    communicating (not hidden by compute), and the bytes it sent. Collective."""
    q, k, v, grad_out = rank_inputs(case, device, group)
    log, comm_seconds = CommLog(), []

    def step() -> None:
        dist.barrier(group)
        log.clear()
        MODES[case.mode](q, k, v, case.causal, group, log).backward(grad_out)
        comm_seconds.append(log.total("seconds"))

    seconds = median_time(step, repeat=repeat, warmup=1)
    return {"seconds": seconds, "comm_seconds": median(comm_seconds[1:]),
            "bytes": {r["op"]: int(log.total("bytes", r["op"])) for r in log.records}}


def context_scaling_worker(device: torch.device, cases: Sequence[CpCase], world_sizes: Sequence[int],
                           repeat: int = 5) -> list[dict] | None:
    """``spawn`` target: each case's rows on each rank count (``mode`` added to each row) on rank 0.

    FLOPs are the attention's matrix products, forward and backward: :math:`12 B h L^2 d_k`, halved when causal.
    """
    torch.set_num_threads(1)
    rows = []
    for c in cases:
        flops = 12 * c.batch * c.heads * c.seq_len**2 * c.head_dim / (2 if c.causal else 1)
        found = _over_rank_counts(world_sizes, lambda group, c=c: context_step_seconds(c, device, group, repeat),
                                  flops, "comm_seconds", "comm_share")
        rows += [{"mode": c.mode, "causal": c.causal, **r} for r in found or []]
    return rows if dist.get_rank() == 0 else None


def measure_scaling(case: Case, world_sizes: Sequence[int] = (1, 2, 4), repeat: int = 5,
                    timeout: float = 300.0, start_method: str = "fork") -> list[dict]:
    """Start ``max(world_sizes)`` CPU ranks and time a step at each rank count; one row per count.

    The ranks are forked by default: they inherit the imported PyTorch, which saves seconds per
    rank on a small machine (``start_method="spawn"`` where fork is not available).
    """
    return spawn(scaling_worker, max(world_sizes), (case, tuple(world_sizes), repeat), timeout=timeout,
                 device="cpu", start_method=start_method)[0]


def measure_context_scaling(cases: Sequence[CpCase], world_sizes: Sequence[int] = (1, 2, 4), repeat: int = 5,
                            timeout: float = 300.0, start_method: str = "fork") -> list[dict]:
    """Start ``max(world_sizes)`` CPU ranks and time each context-parallel case at each rank count."""
    return spawn(context_scaling_worker, max(world_sizes), (tuple(cases), tuple(world_sizes), repeat),
                 timeout=timeout, device="cpu", start_method=start_method)[0]
