r"""Flash attention in Triton: exact attention that never writes the L x L matrix to memory.

Plain attention computes :math:`S = QK^\top / \sqrt{d}` for a whole head, writes it to GPU
memory (HBM), reads it back for the softmax, writes :math:`P`, and reads it again for
:math:`PV`: four trips of :math:`L^2` elements per head, and an :math:`L^2` buffer that
grows quadratically with the sequence. The kernel below (FlashAttention-2, Dao 2023) keeps
a tile of ``BLOCK_M`` query rows in on-chip memory and streams the keys and values past it
in blocks of ``BLOCK_N`` rows. An online softmax (Milakov & Gimelshein 2018) carries three
running quantities per query row across the key blocks:

.. math::
    m_i' = \max\big(m_i, \max_j s_{ij}\big), \qquad
    \ell_i' = e^{m_i - m_i'}\,\ell_i + \sum_j e^{s_{ij} - m_i'}, \qquad
    \mathrm{acc}_i' = e^{m_i - m_i'}\,\mathrm{acc}_i + \sum_j e^{s_{ij} - m_i'}\, v_j

and the output row is :math:`\mathrm{acc}_i / \ell_i`. HBM traffic drops to reading Q, K, V
once per query tile and writing O once, plus one float per row: the log-sum-exp
:math:`m_i + \log \ell_i`, saved for the backward pass. The exponentials use ``exp2`` with
:math:`\log_2 e` folded into the softmax scale, as GPUs compute :math:`2^x` natively.

What the kernel supports:

* causal attention: key blocks wholly above the diagonal are never loaded; blocks wholly
  below it run without a mask; only the diagonal band pays for one;
* grouped-query and multi-query attention: query head ``h`` reads key/value head
  ``h // (H // H_kv)`` through its pointer offset, so K and V are never repeated in memory;
* fp16, bf16 and fp32 inputs on CUDA (fp32 matmuls in IEEE precision, not TF32); fp32 and
  fp64 under the CPU interpreter (``TRITON_INTERPRET=1``), which has no bf16;
* head sizes from 16 to 128: a size that is not a power of two is padded to the next power
  of two inside the kernel, with masked loads and stores (nothing is copied);
* any sequence length: the last key block and the last query tile are masked.

Tile sizes are not fixed: on a GPU, the first launch for each head size, causal flag, dtype and
length bucket (``tiles.length_bucket``) times a few candidate tiles (``tile_candidates``) and keeps the fastest.

The backward pass is Triton too (``mha_lab.cuda.flash_backward``): from the saved log-sum-exp it
rebuilds :math:`P` tile by tile on chip, so training never holds the full :math:`L \times L`
matrix either. ``flash_attention_backward`` below is the same recomputation written in PyTorch,
one block of query rows at a time: slower, but it runs on any device and shows the algorithm.

Layout of this file, as in the Triton tutorials: the tile candidates, the kernel, the wrapper
that validates inputs and launches it, and the backward in PyTorch; its reference in plain PyTorch is
``mha_lab.cuda.attention.attention_ref``, the "eager" backend's core.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mha_lab.cuda.flash_backward import flash_backward
from mha_lab.cuda.tiles import (
    INTERPRET,
    autotune_configs,
    block_d,
    check_head_dim,
    dot_precision,
    key_ranges,
    length_bucket,
    load_tile,
    program_heads,
    pruner,
    tile_list,
)

__all__ = ["flash_attention", "flash_attention_backward", "tile_candidates", "forward_kernel"]

_MAX_GRID_Y = 65535  # CUDA's limit on the grid's second axis, which runs over batch x heads
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETER_DTYPES = (torch.float32, torch.float64)


# Tile candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), timed once per (head size, causal,
# dtype, length bucket) on first use. The first of each list is the usual FlashAttention-2 choice on A100/H100.
# Every candidate compiles for both without register spills (mha_lab.cuda.compiled, checked in
# tests/test_triton_compile.py): the fp32 accumulator holds BLOCK_M x BLOCK_D values spread over
# 32 x num_warps threads, so wide head sizes need more warps or fewer query rows, and 4-byte
# inputs narrower key blocks. The interpreter gets one small tile, so that test-sized inputs
# still span several query tiles, key blocks and ragged tails. On an H200 (book/data/gpu_bench.json)
# each 16-bit candidate won at some length; 128 x 128 tiles, timed there too, never did.
_GPU_TILES = {
    "16-bit, D <= 64": [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3)],
    "16-bit, D > 64": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
    "32-bit, D <= 64": [(64, 32, 8, 2), (32, 32, 4, 2)],
    "32-bit, D > 64": [(64, 16, 8, 2), (32, 16, 4, 2), (32, 16, 4, 3)],
}


def tile_candidates(dtype: torch.dtype, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner times on a GPU for inputs of
    ``dtype`` and head size ``head_dim``; the first is the usual FlashAttention-2 choice."""
    return tile_list(_GPU_TILES, dtype, head_dim)


def forward_kernel(dtype: torch.dtype, head_dim: int, causal: bool) -> tuple[triton.JITFunction, dict[str, object]]:
    """The forward kernel (the ``@triton.jit`` function under the autotuner) and the compile-time
    constants that a launch for this dtype, head size and causal flag passes, tile sizes aside."""
    check_head_dim(head_dim)
    return _attn_fwd.fn, {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "CAUSAL": bool(causal),
                          "DOT_PRECISION": dot_precision(dtype)}


_prune_tiles = pruner(tile_candidates)  # the autotuner's hook: this launch's dtype and head size only
_CONFIGS = autotune_configs(_GPU_TILES)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                    offs_m, offs_d, lo, hi, L, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                    CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Stream the key/value blocks [lo, hi) past the resident query tile, updating m_i, l_i, acc.

    MASKED blocks (the causal diagonal band, the ragged last block) mask out keys beyond L
    and, when CAUSAL, keys after the query; the others need no mask at all.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # key positions of this block
        k = load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      cols, L, offs_d, HEAD_DIM, MASKED, PAD_D)  # (BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=acc.dtype)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = cols[None, :] < L  # (1, BLOCK_N)
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])  # (BLOCK_M, BLOCK_N)
            qk = tl.where(keep, qk, float("-inf"))
        # in base-2 units (scale s log2(e) > 0, so it commutes with max): scale the row maximum once,
        # then each score takes one fused multiply-add before exp2
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK_N), unnormalised probabilities
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                      cols, L, offs_d, HEAD_DIM, MASKED, PAD_D)  # (BLOCK_N, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION, out_dtype=acc.dtype)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_CONFIGS, key=["HEAD_DIM", "CAUSAL", "L_BUCKET"],
                 prune_configs_by={"early_config_prune": _prune_tiles})
@triton.jit
def _attn_fwd(Q, K, V, Out, LSE, sm_scale,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              H, N_REP, L, L_BUCKET,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head); writes their output rows and log-sum-exp."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the causal band then starts on a key-block boundary
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    ACC: tl.constexpr = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32
    start_m = tl.program_id(0)
    off_bh, off_b, off_h, off_h_kv = program_heads(H, N_REP)
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_h_kv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_h_kv.to(tl.int64) * stride_vh
    o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions of this tile
    offs_d = tl.arange(0, BLOCK_D)
    # the query tile stays in registers/shared memory for the whole loop
    q = load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)  # running row maximum (base-2 units)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)  # running unnormalised output
    # fold log2(e) into the scale, exp(x) = exp2(x log2(e)); held in ACC so float64 keeps its precision
    qk_scale = tl.full([], sm_scale * 1.4426950408889634, ACC)

    unmasked_end, masked_end = key_ranges(start_m, L, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, 0, unmasked_end, L, qk_scale,
                                    HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False, DOT_PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, unmasked_end, masked_end, L, qk_scale,
                                    HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True, DOT_PRECISION)

    # epilogue: normalise, and save the natural-log log-sum-exp for the backward pass
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # ln(2): base-2 units -> natural log
    tl.store(LSE + off_bh.to(tl.int64) * L + offs_m, lse, mask=offs_m < L)
    out_mask = (offs_m[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             acc.to(Out.dtype.element_ty), mask=out_mask)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError/TypeError/RuntimeError naming the problem before anything is launched."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, heads, L, D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (B, H, L, D), (B_kv, H_kv, L_kv, D_kv) = q.shape, k.shape
    if (B_kv, L_kv, D_kv) != (B, L, D):
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on batch, length and head size")
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({H_kv})")
    if L < 1 or B < 1:
        raise ValueError(f"empty input: batch {B}, length {L}")
    if B * H > _MAX_GRID_Y:
        raise ValueError(f"batch x heads = {B * H} exceeds the launch grid's limit of {_MAX_GRID_Y}; split the batch")
    check_head_dim(D)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if INTERPRET:
        if q.dtype not in _INTERPRETER_DTYPES:
            raise TypeError(f"dtype {q.dtype} is not supported by the Triton interpreter; use float32 or float64")
    else:
        if q.device.type != "cuda":
            raise RuntimeError(
                f"the Triton kernel needs CUDA tensors, got device {q.device}; use backend='sdpa' or 'eager' "
                "on CPU, or set TRITON_INTERPRET=1 before importing mha_lab.cuda.flash to run it on the CPU"
            )
        if q.dtype not in _CUDA_DTYPES:
            raise TypeError(f"dtype {q.dtype} is not supported on CUDA; use float16, bfloat16 or float32")


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_attn_fwd``: one program per (query tile, batch x head). Returns (out, lse)."""
    B, H, L, D = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, H, L, D)
    lse = torch.empty((B, H, L), dtype=acc_dtype, device=q.device)  # natural-log log-sum-exp per row
    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(L, meta["BLOCK_M"]), B * H)

    _attn_fwd[grid](
        q, k, v, out, lse, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, H // k.shape[1], L, length_bucket(L),
        **forward_kernel(q.dtype, D, causal)[1],
    )
    return out, lse


def flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, grad_out: torch.Tensor, causal: bool, sm_scale: float,
                             block_q: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Gradients of q, k, v by recomputing :math:`P = \exp(sQK^\top - \mathrm{lse})` per block of queries, in PyTorch.

    The algorithm of the Triton backward (``flash_backward``) at the granularity of PyTorch operations,
    on any device:

    .. math:: dV = P^\top dO, \quad dS = P \odot \big(dO\,V^\top - \mathrm{rowsum}(dO \odot O)\big), \quad
              dQ = s\, dS\, K, \quad dK = s\, dS^\top Q

    Query heads are grouped by the key/value head they share, so dK and dV add up the whole
    group without repeating K or V. Causal blocks read only the keys up to their last query.
    Peak extra memory: a few (B, H, block_q, L) buffers. By default ``block_q`` keeps each
    under 2**28 elements (1 GiB in float32), between 16 and 1024 rows; under the interpreter
    it is 16, so that test-sized inputs cross several blocks.
    """
    B, H, L, D = q.shape
    H_kv = k.shape[1]
    if block_q is None:
        block_q = 16 if INTERPRET else max(16, min(1024, 2**28 // (B * H * L)))
    ct = lse.dtype  # compute type: float32, or float64 for float64 inputs
    # (B, H, L, D) -> (B, H_kv, n_rep, L, D): query heads grouped under their shared K/V head
    q_g, do_g, o_g = (t.to(ct).reshape(B, H_kv, H // H_kv, L, D) for t in (q, grad_out, out))
    lse_g = lse.reshape(B, H_kv, H // H_kv, L)  # (B, H, L) -> (B, H_kv, n_rep, L)
    k_g, v_g = k.to(ct)[:, :, None], v.to(ct)[:, :, None]  # (B, H_kv, L, D) -> (B, H_kv, 1, L, D)
    delta = (do_g * o_g).sum(-1)  # (B, H_kv, n_rep, L): rowsum(dO * O) = rowsum(P * dP)
    dq = torch.empty_like(q_g)
    dk = torch.zeros_like(k_g[:, :, 0])  # (B, H_kv, L, D)
    dv = torch.zeros_like(v_g[:, :, 0])
    positions = torch.arange(L, device=q.device)
    for s in range(0, L, block_q):
        e = min(s + block_q, L)
        n = e if causal else L  # causal: keys after the block's last query carry no weight
        k_b, v_b = k_g[..., :n, :], v_g[..., :n, :]  # (B, H_kv, 1, n, D)
        scores = (q_g[..., s:e, :] @ k_b.transpose(-1, -2)) * sm_scale  # (B, H_kv, n_rep, bq, n)
        if causal:
            scores = scores.masked_fill(positions[None, :n] > positions[s:e, None], float("-inf"))
        p = torch.exp(scores - lse_g[..., s:e, None])  # (B, H_kv, n_rep, bq, n), rows sum to 1
        do_b = do_g[..., s:e, :]  # (B, H_kv, n_rep, bq, D)
        dv[..., :n, :] += (p.transpose(-1, -2) @ do_b).sum(2)  # sum over the group -> (B, H_kv, n, D)
        ds = p * (do_b @ v_b.transpose(-1, -2) - delta[..., s:e, None]) * sm_scale  # (B, H_kv, n_rep, bq, n)
        dq[..., s:e, :] = ds @ k_b
        dk[..., :n, :] += (ds.transpose(-1, -2) @ q_g[..., s:e, :]).sum(2)
    dq = dq.reshape(B, H, L, D)  # (B, H_kv, n_rep, L, D) -> (B, H, L, D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _FlashAttention(torch.autograd.Function):
    """Triton forward and Triton backward (``mha_lab.cuda.flash_backward``), joined by the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                sm_scale: float) -> torch.Tensor:
        out, lse = _flash_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None) -> torch.Tensor:
    r"""Exact scaled dot-product attention with the Triton flash kernel; differentiable.

    .. math:: O = \mathrm{softmax}\big(s\,QK^\top + M\big)\,V, \quad s = 1/\sqrt{D} \text{ unless given}

    ``M`` is the causal mask when ``causal`` (query i sees keys 0..i), else zero. Query head
    ``h`` uses key/value head ``h // (H // H_kv)`` (GQA; ``H_kv = 1`` is MQA).

    Shapes: q (B, H, L, D); k, v (B, H_kv, L, D) -> (B, H, L, D), in q's dtype.
    Needs CUDA tensors in fp16, bf16 or fp32 (or fp32/fp64 CPU tensors under
    ``TRITON_INTERPRET=1``); 16 <= D <= 128. Any stride is accepted; nothing is copied.
    The backward is the Triton kernels of ``mha_lab.cuda.flash_backward``, from the saved log-sum-exp.
    """
    if sm_scale is not None and not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
    _check_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return _FlashAttention.apply(q, k, v, bool(causal), scale)
