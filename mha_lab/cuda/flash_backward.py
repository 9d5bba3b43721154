r"""The flash kernel's backward pass in Triton: FlashAttention-2's three launches.

The forward saved, per query row, the output :math:`O` and the log-sum-exp
:math:`\mathrm{lse}_i = \log \sum_j e^{s\,q_i \cdot k_j}`, so any tile of probabilities can be rebuilt
exactly, :math:`P_{ij} = \exp(s\,q_i \cdot k_j - \mathrm{lse}_i)`, without the :math:`L \times L` matrix
ever leaving on-chip memory. With :math:`dP = dO\,V^\top`, the gradients are

.. math::
    \delta_i = \textstyle\sum_d dO_{id} O_{id} = \sum_j P_{ij}\,dP_{ij}, \qquad
    dS = P \odot (dP - \delta), \qquad
    dV = P^\top dO, \quad dK = s\, dS^\top Q, \quad dQ = s\, dS\, K.

Three launches compute them (Dao 2023, Algorithm 2, with dQ in its own pass instead of atomics):

1. ``_bwd_preprocess``: :math:`\delta = \mathrm{rowsum}(dO \odot O)`, one float per query row;
2. ``_bwd_dkdv``: one program per block of ``BLOCK_N`` keys of one key/value head keeps its K, V
   and the dK, dV accumulators on chip, and streams every query block of every query head that
   reads this key/value head (GQA's group) past them: dK and dV are written once, with no atomics;
3. ``_bwd_dq``: one program per block of ``BLOCK_M`` queries keeps Q, dO and dQ on chip and streams
   the key blocks past, as the forward does.

As in the forward, causal attention splits each loop into an unmasked bulk and a masked diagonal
band, and skips the blocks the mask removes whole; the ragged last block is masked too. The
autotuner times the tile candidates once per head size, causal flag, dtype and length bucket.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

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

__all__ = ["flash_backward", "backward_tile_candidates", "backward_kernels"]

LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for each of the two gradient kernels, none spilling registers on
# sm_90 (python -m mha_lab compile --kernel dkdv ...). dK/dV holds two fp32 accumulators of BLOCK_N x D and its
# K and V tiles for the whole loop, so at D = 128 only thin query blocks fit; dQ holds one accumulator of
# BLOCK_M x D. dK/dV needs BLOCK_M | BLOCK_N (its diagonal band is tiled by query blocks), dQ BLOCK_N | BLOCK_M.
_GPU_TILES = {
    "dkdv": {
        "16-bit, D <= 64": [(32, 128, 8, 3), (64, 128, 8, 2), (16, 64, 4, 3)],
        "16-bit, D > 64": [(16, 128, 8, 3), (16, 32, 4, 3)],
        "32-bit, D <= 64": [(32, 32, 8, 2), (16, 32, 4, 2)],
        "32-bit, D > 64": [(16, 16, 4, 2), (16, 32, 4, 1)],
    },
    "dq": {
        "16-bit, D <= 64": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
        "16-bit, D > 64": [(128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
        "32-bit, D <= 64": [(64, 32, 8, 2), (32, 16, 4, 2)],
        "32-bit, D > 64": [(32, 16, 8, 2), (16, 16, 4, 2)],
    },
}
_PREPROCESS_ROWS = 16 if INTERPRET else 64


def backward_tile_candidates(kernel: str, dtype: torch.dtype, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner times for ``kernel`` ("dkdv" or "dq")."""
    check_head_dim(head_dim)
    if kernel not in _GPU_TILES:
        raise ValueError(f"kernel must be 'dkdv' or 'dq', got {kernel!r}")
    return tile_list(_GPU_TILES[kernel], dtype, head_dim)


@triton.jit
def _bwd_preprocess(Out, DO, Delta, stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod, H, L,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = sum_d dO_id O_id for BLOCK_M query rows of one (batch, head)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    off_bh, off_b, off_h, _ = program_heads(H, 1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_tile(Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                  + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                  offs_m, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_M, BLOCK_D)
    do = load_tile(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                   + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                   offs_m, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(Delta.dtype.element_ty) * do.to(Delta.dtype.element_ty), 1)  # (BLOCK_M,)
    tl.store(Delta + off_bh.to(tl.int64) * L + offs_m, delta, mask=offs_m < L)


@triton.jit
def _load_rows(ptr, rows, L, MASKED: tl.constexpr):
    """One float per query row (lse or delta); rows >= L read 0 where MASKED."""
    if MASKED:
        x = tl.load(ptr + rows, mask=rows < L, other=0.0)
    else:
        x = tl.load(ptr + rows)
    return x


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,
                    offs_n, offs_d, lo, hi, L, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Stream the query blocks [lo, hi) past the resident key block, adding to dV = P^T dO and dK/s = dS^T Q.

    Works transposed, keys by queries, so both are plain products. MASKED blocks (the causal band,
    the ragged last block) drop query rows beyond L and, when CAUSAL, pairs whose key is after the query.
    """
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m  # query positions of this block
        q = load_tile(q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                      rows, L, offs_d, HEAD_DIM, MASKED, PAD_D)  # (BLOCK_M, BLOCK_D)
        lse = _load_rows(lse_base, rows, L, MASKED)  # (BLOCK_M,), base-2 units
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=dk.dtype)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])  # P^T, rebuilt from the saved log-sum-exp
        if MASKED:
            keep = rows[None, :] < L  # (1, BLOCK_M)
            if CAUSAL:
                keep = keep & (rows[None, :] >= offs_n[:, None])  # (BLOCK_N, BLOCK_M)
            p_t = tl.where(keep, p_t, 0.0)
        do = load_tile(do_base + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                       rows, L, offs_d, HEAD_DIM, MASKED, PAD_D)  # (BLOCK_M, BLOCK_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=dv.dtype)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=dk.dtype)  # (BLOCK_N, BLOCK_M)
        delta = _load_rows(delta_base, rows, L, MASKED)  # (BLOCK_M,)
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T, without the scale s
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=dk.dtype)
    return dk, dv


@triton.autotune(configs=autotune_configs(_GPU_TILES["dkdv"]), key=["HEAD_DIM", "CAUSAL", "L_BUCKET"],
                 prune_configs_by={"early_config_prune": pruner(partial(backward_tile_candidates, "dkdv"))})
@triton.jit
def _bwd_dkdv(Q, K, V, DO, DK, DV, LSE, Delta, sm_scale,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dob, stride_doh, stride_dom, stride_dod,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
              H, N_REP, L, L_BUCKET,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_N keys of one (batch, key/value head); writes their dK and dV rows."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)  # the causal band is tiled by whole query blocks
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    ACC: tl.constexpr = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32
    H_kv = H // N_REP
    off_bkv = tl.program_id(1)  # flattened (batch, key/value head)
    off_b = off_bkv // H_kv
    off_h_kv = off_bkv % H_kv
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)  # key positions of this block
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(K + off_b.to(tl.int64) * stride_kb + off_h_kv.to(tl.int64) * stride_kh
                  + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                  offs_n, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_N, BLOCK_D)
    v = load_tile(V + off_b.to(tl.int64) * stride_vb + off_h_kv.to(tl.int64) * stride_vh
                  + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                  offs_n, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    qk_scale = tl.full([], sm_scale * 1.4426950408889634, ACC)  # s log2(e): scores in base-2 units

    # causal: queries before the block's first key see none of it (skipped); the band up to its last key
    # needs the mask; later queries see every key (unmasked bulk). Either way a ragged last query block is masked.
    if CAUSAL:
        band_lo = start_n
        bulk_lo = start_n + BLOCK_N
    else:
        band_lo = 0
        bulk_lo = 0
    band_hi = tl.minimum(bulk_lo, L)
    bulk_hi = tl.maximum(bulk_lo, bulk_lo + (L - bulk_lo) // BLOCK_M * BLOCK_M)
    for rep in range(N_REP):  # every query head that reads this key/value head adds to its dK, dV
        off_h = off_h_kv * N_REP + rep  # a query head of the group
        off_bh = off_b * H + off_h  # flattened (batch, query head), as the forward's LSE rows
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        lse_base = LSE + off_bh.to(tl.int64) * L
        delta_base = Delta + off_bh.to(tl.int64) * L
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
                                 stride_dom, stride_dod, offs_n, offs_d, band_lo, band_hi, L, qk_scale,
                                 HEAD_DIM, BLOCK_M, PAD_D, CAUSAL, True, DOT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
                                 stride_dom, stride_dod, offs_n, offs_d, bulk_lo, bulk_hi, L, qk_scale,
                                 HEAD_DIM, BLOCK_M, PAD_D, CAUSAL, False, DOT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
                                 stride_dom, stride_dod, offs_n, offs_d, bulk_hi, L, L, qk_scale,
                                 HEAD_DIM, BLOCK_M, PAD_D, CAUSAL, True, DOT_PRECISION)

    keep = (offs_n[:, None] < L) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + off_b.to(tl.int64) * stride_dkb + off_h_kv.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=keep)
    tl.store(DV + off_b.to(tl.int64) * stride_dvb + off_h_kv.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=keep)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                  offs_m, offs_d, lo, hi, L, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, CAUSAL: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Stream the key blocks [lo, hi) past the resident query block, adding dS K (dQ without the scale)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # key positions of this block
        k = load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                      cols, L, offs_d, HEAD_DIM, MASKED, PAD_D)  # (BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=dq.dtype)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            keep = cols[None, :] < L  # (1, BLOCK_N)
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])  # (BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        v = load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                      cols, L, offs_d, HEAD_DIM, MASKED, PAD_D)  # (BLOCK_N, BLOCK_D)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=dq.dtype)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=dq.dtype)
    return dq


@triton.autotune(configs=autotune_configs(_GPU_TILES["dq"]), key=["HEAD_DIM", "CAUSAL", "L_BUCKET"],
                 prune_configs_by={"early_config_prune": pruner(partial(backward_tile_candidates, "dq"))})
@triton.jit
def _bwd_dq(Q, K, V, DO, DQ, LSE, Delta, sm_scale,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            H, N_REP, L, L_BUCKET,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head); writes their dQ rows."""
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # the causal band then starts on a key-block boundary
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    ACC: tl.constexpr = tl.float64 if Q.dtype.element_ty == tl.float64 else tl.float32
    start_m = tl.program_id(0)
    off_bh, off_b, off_h, off_h_kv = program_heads(H, N_REP)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                  + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_M, BLOCK_D)
    do = load_tile(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                   + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                   offs_m, L, offs_d, HEAD_DIM, True, PAD_D)  # (BLOCK_M, BLOCK_D)
    lse = _load_rows(LSE + off_bh.to(tl.int64) * L, offs_m, L, True)  # (BLOCK_M,), base-2 units
    delta = _load_rows(Delta + off_bh.to(tl.int64) * L, offs_m, L, True)  # (BLOCK_M,)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_h_kv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_h_kv.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    qk_scale = tl.full([], sm_scale * 1.4426950408889634, ACC)

    unmasked_end, masked_end = key_ranges(start_m, L, BLOCK_M, BLOCK_N, CAUSAL)  # as in the forward
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_d, 0, unmasked_end, L, qk_scale, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, False,
                       DOT_PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_d, unmasked_end, masked_end, L, qk_scale, HEAD_DIM, BLOCK_N, PAD_D, CAUSAL, True,
                       DOT_PRECISION)
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < L) & (offs_d[None, :] < HEAD_DIM))


def backward_kernels(dtype: torch.dtype, head_dim: int, causal: bool) -> dict[str, tuple[triton.JITFunction, dict]]:
    """The dK/dV and dQ kernels (``@triton.jit`` functions under their autotuners) and the compile-time
    constants a launch for this dtype, head size and causal flag passes, tile sizes aside."""
    check_head_dim(head_dim)
    constants = {"HEAD_DIM": head_dim, "BLOCK_D": block_d(head_dim), "CAUSAL": bool(causal),
                 "DOT_PRECISION": dot_precision(dtype)}
    return {"dkdv": (_bwd_dkdv.fn, dict(constants)), "dq": (_bwd_dq.fn, dict(constants))}


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, causal: bool,
                   sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of ``flash_attention`` from its saved output and natural-log ``lse``, in three launches.

    Shapes: q, out, grad_out (B, H, L, D); k, v (B, H_kv, L, D); lse (B, H, L) -> dq (B, H, L, D),
    dk, dv (B, H_kv, L, D), each in its input's dtype. Extra memory: two floats per query row.
    """
    B, H, L, D = q.shape
    H_kv = k.shape[1]
    lse2 = lse * LOG2E  # (B, H, L): natural log -> base 2, the kernels' units
    delta = torch.empty_like(lse)  # (B, H, L)
    _bwd_preprocess[(triton.cdiv(L, _PREPROCESS_ROWS), B * H)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), H, L,
        HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK_M=_PREPROCESS_ROWS)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    kernels = backward_kernels(q.dtype, D, causal)
    common = (H, H // H_kv, L, length_bucket(L))
    _bwd_dkdv[lambda meta: (triton.cdiv(L, meta["BLOCK_N"]), B * H_kv)](
        q, k, v, grad_out, dk, dv, lse2, delta, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(), *common,
        **kernels["dkdv"][1])
    _bwd_dq[lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), B * H)](
        q, k, v, grad_out, dq, lse2, delta, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(), *common,
        **kernels["dq"][1])
    return dq, dk, dv
