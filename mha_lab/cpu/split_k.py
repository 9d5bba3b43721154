r"""Split-K decoding (Flash-Decoding, Dao et al. 2023), in NumPy, and how many programs it launches.

Decoding has one query per sequence, so FlashAttention-2's grid (one program per batch
element, head and block of queries) has only B·h programs: a batch of one leaves most of a
GPU idle however long the cache is. Flash-Decoding splits the cache into chunks, lets one
program attend to each chunk with the online softmax, and merges the partial states. Chunk
c leaves a row maximum :math:`m_c`, a normaliser :math:`\ell_c` and an unnormalised output
:math:`a_c`; with :math:`M = \max_c m_c`,

.. math:: o = \frac{\sum_c e^{m_c - M} a_c}{\sum_c e^{m_c - M} \ell_c}

which is exactly the softmax over the whole cache.
"""

from __future__ import annotations

import math

import numpy as np

from mha_lab.cpu.memory import online_softmax_step

__all__ = ["split_k_partials", "merge_partials", "split_k_attention", "num_splits_heuristic", "decode_programs"]


def split_k_partials(q: np.ndarray, K: np.ndarray, V: np.ndarray, num_splits: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chunk's state (m, l, acc) after the online softmax over its keys alone.

    Shapes: q (..., 1, d); K (..., T, d); V (..., T, d_v) ->
    m, l (num_splits, ..., 1, 1); acc (num_splits, ..., 1, d_v). The T keys are cut into
    ``num_splits`` chunks as equal as possible; a chunk may not be empty.
    """
    T = K.shape[-2]
    if not 1 <= num_splits <= T:
        raise ValueError(f"num_splits must be between 1 and the number of keys T={T}, got {num_splits}")
    bounds = np.linspace(0, T, num_splits + 1).round().astype(int)
    q = q / np.sqrt(q.shape[-1])
    states = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        m = np.full(q.shape[:-1] + (1,), -np.inf)  # (..., 1, 1)
        acc = np.zeros(q.shape[:-1] + (V.shape[-1],))  # (..., 1, d_v)
        scores = q @ np.swapaxes(K[..., s:e, :], -1, -2)  # (..., 1, chunk)
        states.append(online_softmax_step(m, np.zeros_like(m), acc, scores, V[..., s:e, :]))
    m, l, acc = (np.stack(x) for x in zip(*states, strict=True))  # each (num_splits, ...)
    return m, l, acc


def merge_partials(m: np.ndarray, l: np.ndarray,
                   acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge chunk states along axis 0 by their log-sum-exp; returns (output, lse).

    Shapes: m, l (S, ..., 1); acc (S, ..., d_v) -> output (..., d_v), lse (..., 1).
    """
    M = m.max(axis=0)  # (..., 1): the global row maximum
    w = np.exp(m - M)  # (S, ..., 1): each chunk rescaled to the global maximum
    denom = (w * l).sum(axis=0)
    return (w * acc).sum(axis=0) / denom, M + np.log(denom)


def split_k_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, num_splits: int) -> np.ndarray:
    """Attention of one query over T keys, computed in ``num_splits`` chunks and merged.

    Shapes: q (..., 1, d); K (..., T, d); V (..., T, d_v) -> (..., 1, d_v).
    """
    return merge_partials(*split_k_partials(q, K, V, num_splits))[0]


def num_splits_heuristic(programs: int, num_sms: int, num_key_blocks: int, max_splits: int = 128) -> int:
    """How many chunks FlashAttention-2's split-KV path cuts the keys into (its ``num_splits_heuristic``).

    ``num_sms`` is what the heuristic is given: FlashAttention-2 passes twice the SMs (two
    128-thread programs per SM); ``decode_programs`` does the same. No split when the B·h
    programs already fill 80% of those slots. Otherwise, among the split counts that change the
    chunk size, the wave efficiency of n splits is (programs·n / slots) divided by its ceiling;
    the smallest n within 85% of the best efficiency wins.
    """
    if programs >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_key_blocks)

    def efficiency(n: int) -> float:
        waves = programs * n / num_sms
        return waves / math.ceil(waves)

    eligible = [n for n in range(1, max_splits + 1)
                if n == 1 or math.ceil(num_key_blocks / n) != math.ceil(num_key_blocks / (n - 1))]
    best = max(efficiency(n) for n in eligible)
    return next(n for n in eligible if efficiency(n) >= 0.85 * best)


def decode_programs(batch: int, heads: int, seq_len: int, num_sms: int = 132,
                    block_n: int = 128, programs_per_sm: int = 2) -> dict[str, float]:
    """Programs launched for one decoding step, without and with split-K, and the share of slots busy.

    FlashAttention-2's split-KV kernel runs programs of 128 threads, and its dispatcher counts
    ``programs_per_sm`` = 2 of them per SM: the heuristic sees ``num_sms * programs_per_sm`` slots.
    Returns ``flash2`` (B·h programs), ``splits``, ``split_k`` (B·h·splits programs), ``slots`` and
    the share of the slots that the waves of each fill (``flash2_busy``, ``split_k_busy``).
    ``block_n`` is the key block a program reads per step.
    """
    programs, slots = batch * heads, num_sms * programs_per_sm
    splits = num_splits_heuristic(programs, slots, math.ceil(seq_len / block_n))

    def busy(n: int) -> float:
        return n / (math.ceil(n / slots) * slots)

    return {"flash2": programs, "splits": splits, "split_k": programs * splits, "slots": slots,
            "flash2_busy": busy(programs), "split_k_busy": busy(programs * splits)}
