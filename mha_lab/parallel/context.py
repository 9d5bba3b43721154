r"""Context parallelism on a ``torch.distributed`` group: ring attention and DeepSpeed-Ulysses.

Every rank holds a block of the sequence: its queries, keys and values (B, h, L/N, d_k), after
the projections, which need no communication. Two ways to attend over the whole sequence:

* **Ring attention** (Liu et al. 2023): the key/value blocks travel round the ring while each
  rank keeps its queries and merges each block into its output by the log-sum-exp,
  :math:`\mathrm{lse}' = \log(e^{\mathrm{lse}} + e^{\mathrm{lse}_b})`,
  :math:`o' = e^{\mathrm{lse} - \mathrm{lse}'} o + e^{\mathrm{lse}_b - \mathrm{lse}'} o_b`
  (the (m, l, acc) merge with :math:`\mathrm{lse} = m + \log \ell`). Backward sends the blocks
  round again, and their gradients travel with them back to their owner. Causal runs on the
  zigzag split of ``mha_lab.parallel.sequence``, which decides what each step computes.
* **Ulysses** (Jacobs et al. 2023): one all-to-all turns sequence-sharded Q, K, V into
  head-sharded ones (every rank: h/N heads, the whole sequence), attention runs locally, and one
  all-to-all turns the output back. Backward is the same all-to-alls in reverse.
  Needs h and h_kv divisible by N.

Both log what each rank sends to the others in a ``CommLog``; ``mha_lab.parallel.cost`` has the
formulas. The block arithmetic is written out (not SDPA) because the merge needs each block's lse.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from mha_lab.parallel.layer import CommLog
from mha_lab.parallel.sequence import ring_part

__all__ = ["check_heads", "RingAttention", "ring_attention", "ulysses_attention", "block_attention",
           "block_attention_backward"]


def check_heads(n_heads: int, n_kv_heads: int, world_size: int) -> None:
    """Ulysses shards the heads after its all-to-all: both head counts must divide by the ranks."""
    if n_heads % n_kv_heads:
        raise ValueError(f"num_heads={n_heads} is not a multiple of num_kv_heads={n_kv_heads}")
    for name, n in (("num_heads", n_heads), ("num_kv_heads", n_kv_heads)):
        if n % world_size:
            raise ValueError(f"Ulysses needs {name} divisible by the world size: {name}={n}, world_size="
                             f"{world_size}; each rank attends with {name}/N heads over the whole sequence "
                             "(use ring attention, which has no such limit)")


def _expand(kv: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, h_kv, L, d) -> (B, h, L, d): each key/value head repeated for the query heads of its group."""
    return kv.repeat_interleave(n_rep, dim=1) if n_rep > 1 else kv


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * scale  # (B, h, Lq, Lk)
    if causal:  # aligned top-left: Lq == Lk, the zigzag's own chunks
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s


def _fused_cpu(q: torch.Tensor) -> bool:
    """PyTorch's fused CPU attention kernel, the one its SDPA runs on the CPU, returns the lse too: use it there."""
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One block's output and log-sum-exp, :math:`\mathrm{lse} = \log \sum_j e^{s_j}`.

    Shapes: q (B, h, Lq, d); k, v (B, h, Lk, d) -> (B, h, Lq, d), (B, h, Lq, 1). On the CPU the fused
    kernel computes the same (the tests compare the two paths).
    """
    if _fused_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.unsqueeze(-1)  # (B, h, Lq) -> (B, h, Lq, 1)
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def block_attention_backward(dout: torch.Tensor, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool) -> tuple:
    r"""One block's share of the gradients, from the final output and lse of these query rows.

    .. math:: P = e^{S - \mathrm{lse}},\ dV = P^\top dO,\ dS = P \circ (dO V^\top - \delta),\
              dQ = s\, dS K,\ dK = s\, dS^\top Q, \quad \delta = \mathrm{rowsum}(dO \circ O)
    """
    if _fused_cpu(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, scale, causal) - lse)  # (B, h, Lq, Lk)
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(dim=-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout


class _Ring:
    """Send a list of tensors to the next rank and receive as many from the previous one, logged."""

    def __init__(self, group: dist.ProcessGroup | None, log: CommLog) -> None:
        self.group, self.log = group, log
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next, self.prev = peer((self.rank + 1) % self.size), peer((self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor], op: str) -> tuple:
        """Start sending ``tensors`` on and receiving as many from the previous rank; ``finish`` returns those."""
        tensors = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in got]
        start = time.perf_counter()
        requests = dist.batch_isend_irecv(ops)
        record = {"op": op, "numel": sum(t.numel() for t in tensors),
                  "bytes": sum(t.numel() * t.element_size() for t in tensors),
                  "seconds": time.perf_counter() - start}
        self.log.records.append(record)
        return requests, got, record

    @staticmethod
    def finish(pending: tuple) -> list[torch.Tensor]:
        """Wait for a ``start``'s transfers and return the tensors received.

        The log's seconds are those spent starting and waiting: the communication the compute did not hide.
        """
        requests, got, record = pending
        start = time.perf_counter()
        for r in requests:
            r.wait()
        record["seconds"] += time.perf_counter() - start
        return got


def _rows_and_keys(part: str, half: int) -> tuple[slice, slice]:
    """The query rows and key rows that ``ring_part`` says meet at this step."""
    every = slice(None)
    return (slice(half, None) if part == "second queries" else every,
            slice(None, half) if part == "first keys" else every)


class RingAttention(torch.autograd.Function):
    """Ring attention over ``group``, forward and backward; called through ``ring_attention``."""

    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, group: dist.ProcessGroup | None,
                log: CommLog) -> torch.Tensor:
        ring = _Ring(group, log)
        scale, n_rep = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)  # (B, h, L/N, d), and its lse (B, h, L/N, 1):
        lse = torch.full_like(q[..., :1], -math.inf)
        kv = [k, v]
        for step in range(ring.size):
            if step + 1 < ring.size:  # send on while this block is computed
                pending = ring.start(kv, "K/V forward")
            part = ring_part(ring.size, ring.rank, step, causal)
            rows, keys = _rows_and_keys(part, q.shape[-2] // 2)
            k_b, v_b = (_expand(t[..., keys, :], n_rep) for t in kv)
            o_b, lse_b = block_attention(q[..., rows, :], k_b, v_b, scale,
                                         part == "causal")
            old = lse[..., rows, :]
            new = torch.logaddexp(old, lse_b)  # the merge, in log space
            out[..., rows, :] = (torch.exp(old - new) * out[..., rows, :]
                                 + torch.exp(lse_b - new) * o_b)
            lse[..., rows, :] = new
            if step + 1 < ring.size:
                kv = ring.finish(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.log = causal, group, log
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.log)
        scale, n_rep, half = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1], q.shape[-2] // 2
        B, h_kv = k.shape[:2]
        dq = torch.zeros_like(q)
        kv, dkv, dkv_pending = [k, v], None, None
        for step in range(ring.size):
            kv_pending = ring.start(kv, "K/V backward") if step + 1 < ring.size else None
            part = ring_part(ring.size, ring.rank, step, ctx.causal)
            rows, keys = _rows_and_keys(part, half)
            dq_b, dk_b, dv_b = block_attention_backward(
                dout[..., rows, :], out[..., rows, :], q[..., rows, :], _expand(kv[0][..., keys, :], n_rep),
                _expand(kv[1][..., keys, :], n_rep), lse[..., rows, :], scale, part == "causal")
            dq[..., rows, :] += dq_b
            # (B, h, Lk, d) -> (B, h_kv, n_rep, Lk, d) -> (B, h_kv, Lk, d): a shared head's gradient is its group's sum
            dk_b, dv_b = (g.view(B, h_kv, n_rep, *g.shape[-2:]).sum(dim=2) for g in (dk_b, dv_b))
            if dkv_pending is None:  # step 0: this rank starts the gradients of its own block
                dkv = [torch.zeros_like(k), torch.zeros_like(v)]
            else:  # the gradients of the block now held, from the ranks it has visited
                dkv = ring.finish(dkv_pending)
            dkv[0][..., keys, :] += dk_b
            dkv[1][..., keys, :] += dv_b
            dkv_pending = ring.start(dkv, "dK/dV backward") if ring.size > 1 else None
            if kv_pending is not None:
                kv = ring.finish(kv_pending)
        if dkv_pending is not None:  # one more hop: the gradients of this rank's own block come home
            dkv = ring.finish(dkv_pending)
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   group: dist.ProcessGroup | None = None, log: CommLog | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, the key/value blocks passed round ``group``.

    Shapes: q (B, h, L/N, d); k, v (B, h_kv, L/N, d) -> (B, h, L/N, d). Each rank holds its block of
    the sequence: contiguous without a mask, the zigzag split (``shard_sequence(..., zigzag=True)``)
    when ``causal``. Collective: every rank of ``group`` calls it with the same shapes.
    """
    _check_qkv(q, k, v)
    if causal and q.shape[-2] % 2:
        raise ValueError(f"causal ring attention runs on the zigzag split: each rank holds two chunks of equal "
                         f"length, but its block has {q.shape[-2]} positions")
    return RingAttention.apply(q, k, v, causal, group, CommLog() if log is None else log)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q, k, v must be (B, h, L/N, d) and k, v of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, L/N and d, and the query heads "
                         "must be a multiple of the key/value heads")


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded (B, h, L/N, d) to head-sharded (B, h/N, L, d), or back; backward is the inverse."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, to_heads: bool, group, log: CommLog, op: str) -> torch.Tensor:
        ctx.to_heads, ctx.group, ctx.log, ctx.op = to_heads, group, log, op
        return _all_to_all(x, to_heads, group, log, op)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, not ctx.to_heads, ctx.group, ctx.log, ctx.op.replace("forward", "backward")), \
            None, None, None, None


def _all_to_all(x: torch.Tensor, to_heads: bool, group, log: CommLog, op: str) -> torch.Tensor:
    """Sequence-sharded (B, h, L/N, d) -> head-sharded (B, h/N, L, d) when ``to_heads``, else the reverse."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:  # one rank holds every head of every position already: nothing to send
        log.records.append({"op": op, "numel": 0, "bytes": 0, "seconds": 0.0})
        return x
    # to heads: send head group j to rank j; back: send sequence block j to rank j
    parts = [p.contiguous() for p in x.chunk(n, dim=1 if to_heads else 2)]
    got = [torch.empty_like(p) for p in parts]
    start = time.perf_counter()
    dist.all_to_all(got, parts, group=group)
    sent = sum(p.numel() for j, p in enumerate(parts) if j != rank)  # the part kept is not sent
    log.records.append({"op": op, "numel": sent, "bytes": sent * x.element_size(),
                        "seconds": time.perf_counter() - start})
    # received: from rank j its sequence block of my heads (to heads), or my sequence block of its heads (back)
    return torch.cat(got, dim=2 if to_heads else 1)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      causal: bool = False, group: dist.ProcessGroup | None = None,
                      log: CommLog | None = None) -> torch.Tensor:
    """This rank's contiguous block by DeepSpeed-Ulysses: all-to-all, attend, back.

    Shapes: q (B, h, L/N, d); k, v (B, h_kv, L/N, d) -> (B, h, L/N, d);
    h and h_kv divisible by N. Collective: every rank of ``group`` calls it.
    """
    _check_qkv(q, k, v)
    check_heads(q.shape[1], k.shape[1], dist.get_world_size(group))
    log = CommLog() if log is None else log
    op = "all-to-all forward"
    # (B, h, L/N, d) -> (B, h/N, L, d); k and v alike with h_kv
    q, k, v = (_AllToAll.apply(t, True, group, log, op) for t in (q, k, v))
    z = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                       enable_gqa=q.shape[1] != k.shape[1])
    # (B, h/N, L, d) -> (B, h, L/N, d)
    return _AllToAll.apply(z, False, group, log, op)
