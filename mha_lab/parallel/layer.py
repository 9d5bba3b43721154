r"""Tensor-parallel attention on a ``torch.distributed`` process group (Megatron-LM).

Every rank of the group holds a block of query heads: the columns of :math:`W_Q, W_K, W_V`
that compute them (column-parallel) and the rows of :math:`W_O` that read them (row-parallel).
Which heads a rank holds is decided by ``mha_lab.parallel.heads.rank_heads``, the function the
NumPy simulation uses too. Two conjugate operators carry all the communication:

* :math:`f`, before the column-parallel projections: identity forward, all-reduce of
  :math:`\nabla_X` backward (the input is replicated, each rank sees only its heads' part);
* :math:`g`, after the row-parallel projection: all-reduce forward (the sum of the partial
  outputs), identity backward.

A key/value head replicated on several ranks (fewer K/V heads than ranks) is a replicated
input of those ranks, so its weights pass through their own :math:`f` over that group.
Nothing here names a device or a backend: gloo with CPU tensors and NCCL with CUDA tensors
run the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from mha_lab.cuda.attention import MultiHeadAttention
from mha_lab.parallel.heads import check_split, head_columns, rank_heads, replica_groups

__all__ = ["CommLog", "CopyToParallel", "ReduceFromParallel", "TensorParallelAttention"]

_KV_GROUPS: dict[tuple, dist.ProcessGroup] = {}  # (world group, global ranks) -> the group of those ranks


@dataclass
class CommLog:
    """Every all-reduce a layer started: where (``op``), elements, bytes handed in, seconds spent."""

    records: list[dict] = field(default_factory=list)

    def total(self, key: str = "bytes", op: str | None = None) -> float:
        """Sum of ``key`` ("bytes", "numel", "seconds") over the records, or over those of one ``op``."""
        return sum(r[key] for r in self.records if op is None or r["op"] == op)

    def clear(self) -> None:
        self.records.clear()


def _all_reduce(t: torch.Tensor, group, log: CommLog, op: str) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place, and log its size and the time it took (waiting included)."""
    start = time.perf_counter()
    dist.all_reduce(t, group=group)
    log.records.append({"op": op, "numel": t.numel(), "bytes": t.numel() * t.element_size(),
                        "seconds": time.perf_counter() - start})
    return t


class CopyToParallel(torch.autograd.Function):
    r"""Megatron's :math:`f`: identity forward; all-reduce of the gradient backward.

    Backward: :math:`\nabla_X = \sum_r \nabla_X^{(r)}`, one part per rank.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None,
                log: CommLog, op: str) -> torch.Tensor:
        ctx.group, ctx.log, ctx.op = group, log, op
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        grad = grad.clone(memory_format=torch.contiguous_format)  # summed in place
        return _all_reduce(grad, ctx.group, ctx.log, ctx.op), None, None, None


class ReduceFromParallel(torch.autograd.Function):
    r"""Megatron's :math:`g`: all-reduce forward; identity backward.

    Forward: :math:`\mathrm{out} = \sum_r \mathrm{partial}^{(r)}` (row-parallel).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, partial: torch.Tensor,
                group: dist.ProcessGroup | None, log: CommLog) -> torch.Tensor:
        out = partial.clone(memory_format=torch.contiguous_format)  # summed in place
        return _all_reduce(out, group, log, "g forward")

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        return grad, None, None


class TensorParallelAttention(nn.Module):
    r"""One rank's share of a ``mha_lab.cuda.MultiHeadAttention``, on a ``torch.distributed`` group.

    .. math:: \mathrm{out} = g\Big(\mathrm{Concat}_{i \in r}(\mathrm{head}_i)\, W_O^{[r]}\Big) + b_O,
              \quad \mathrm{head}_i \text{ computed from } f(X)

    Built collectively: every rank of ``group`` constructs it from the same single-device
    ``layer`` and keeps copies of its own slices. Shapes on rank r, with :math:`h_r = h/N` query
    heads and :math:`g_r` key/value heads: W_Q: (d_model, h_r d_k); W_K, W_V: (d_model, g_r d_k);
    W_O: (h_r d_k, d_model); b_O: (d_model,), whole on every rank and added once, after :math:`g`.
    The input x is (B, L, d_model), the same on every rank; so is the output.
    """

    def __init__(self, layer: MultiHeadAttention, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(layer, MultiHeadAttention):
            raise TypeError(f"layer must be a mha_lab.cuda.MultiHeadAttention (MultiHeadAttention.from_numpy "
                            f"converts a NumPy layer), got {type(layer).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("no torch.distributed process group: call torch.distributed.init_process_group "
                               "first, or launch with torchrun or python -m mha_lab tp")
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        check_split(layer.num_heads, layer.num_kv_heads, world_size)  # before any collective, on every rank
        self.group, self.world_size, self.rank = group, world_size, rank
        self.d_model, self.num_heads, self.num_kv_heads, self.d_k = (layer.d_model, layer.num_heads,
                                                                     layer.num_kv_heads, layer.d_k)
        self.causal, self.use_bias = layer.causal, layer.use_bias
        self.q_heads, self.kv_heads = rank_heads(layer.num_heads, layer.num_kv_heads, world_size, rank)
        for name, index in self.shard_index().items():
            full = getattr(layer, name)
            if full is not None:
                self.register_parameter(name, nn.Parameter(full.detach()[index].clone()))
            else:
                self.register_parameter(name, None)
        self.kv_group = self._kv_group(group)
        self.comm = CommLog()

    def shard_index(self) -> dict[str, tuple[slice, ...]]:
        """Where each parameter of this rank sits in the single-device layer's parameter of the same name."""
        q, kv, every = head_columns(self.q_heads, self.d_k), head_columns(self.kv_heads, self.d_k), slice(None)
        return {"W_Q": (every, q), "W_K": (every, kv), "W_V": (every, kv), "W_O": (q, every),
                "b_Q": (q,), "b_K": (kv,), "b_V": (kv,), "b_O": (every,)}

    def _kv_group(self, group) -> dist.ProcessGroup | None:
        """The group of ranks holding this rank's key/value heads, or None when no other rank holds them.

        Only the ranks of the new group take part in creating it (local synchronisation), so
        layers on disjoint groups of one job can be built at the same time; every layer on the
        same ranks shares one group, created once.
        """
        mine = next(ranks for ranks in replica_groups(self.num_heads, self.num_kv_heads, self.world_size)
                    if self.rank in ranks)
        if len(mine) == 1:
            return None
        key = (dist.group.WORLD, tuple(dist.get_global_rank(group, r) if group is not None else r for r in mine))
        if key not in _KV_GROUPS:
            _KV_GROUPS[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
        return _KV_GROUPS[key]

    def extra_repr(self) -> str:
        return (f"rank={self.rank}/{self.world_size}, query heads {list(self.q_heads)}, "
                f"key/value heads {list(self.kv_heads)}, causal={self.causal}, bias={self.use_bias}")

    _check_input = MultiHeadAttention._check_input  # the single-device layer's checks: they read only d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, L, d_model); x is checked before any collective."""
        self._check_input(x)
        B, L, _ = x.shape
        h_r, g_r, d_k = len(self.q_heads), len(self.kv_heads), self.d_k
        x = CopyToParallel.apply(x, self.group, self.comm, "f backward")
        kv = [self.W_K, self.W_V, self.b_K, self.b_V]
        if self.kv_group is not None:  # shared K/V head: sum its weights' gradients
            kv = [None if t is None else CopyToParallel.apply(
                t, self.kv_group, self.comm, "K/V grads backward") for t in kv]
        W_K, W_V, b_K, b_V = kv
        # column-parallel: (B, L, d_model) -> (B, L, h_r*d_k), (B, L, g_r*d_k)
        q, k, v = x @ self.W_Q, x @ W_K, x @ W_V
        if self.use_bias:
            q, k, v = q + self.b_Q, k + b_K, v + b_V
        q = q.view(B, L, h_r, d_k).transpose(1, 2)  # -> (B, h_r, L, d_k)
        k = k.view(B, L, g_r, d_k).transpose(1, 2)  # -> (B, g_r, L, d_k)
        v = v.view(B, L, g_r, d_k).transpose(1, 2)  # -> (B, g_r, L, d_k)
        z = F.scaled_dot_product_attention(  # (B, h_r, L, d_k)
            q, k, v, is_causal=self.causal, enable_gqa=h_r > g_r)
        z = z.transpose(1, 2).reshape(B, L, h_r * d_k)  # -> (B, L, h_r*d_k)
        # row-parallel: this rank's partial output (B, L, d_model), summed by g
        out = ReduceFromParallel.apply(z @ self.W_O, self.group, self.comm)
        return out + self.b_O if self.use_bias else out  # b_O once, after the sum
