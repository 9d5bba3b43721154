r"""RoPE past its training length: the base, position interpolation, NTK-aware scaling, YaRN, partial rotary.

RoPE rotates pair i of a head by :math:`p\,\omega_i` with frequencies
:math:`\omega_i = \theta_\text{base}^{-2i/d_k}`, i < d_k/2. Pair i turns once every
:math:`\lambda_i = 2\pi / \omega_i` positions. A model trained on :math:`L_\text{train}` positions
has seen the slow pairs turn through only part of a circle; at a longer context they reach angles
it never saw. Each method below changes the frequencies so that a context :math:`\kappa` times
longer (``factor``; s in the papers) stays within what was trained:

- a larger base :math:`\theta_\text{base}` (Llama 3: 500,000 instead of 10,000) slows every pair;
- position interpolation (Chen et al. 2023) divides every frequency by :math:`\kappa`;
- NTK-aware scaling raises the base to :math:`\theta_\text{base}\,\kappa^{d_k/(d_k-2)}`: the fastest
  pair keeps its frequency, the slowest is divided by :math:`\kappa`;
- YaRN (Peng et al. 2023) interpolates only the pairs that turn less than
  :math:`\beta_\text{slow}` times over :math:`L_\text{train}`, keeps those that turn more than
  :math:`\beta_\text{fast}` times (the paper's :math:`\alpha` and :math:`\beta`), ramps in
  between, and sharpens the softmax by :math:`(0.1 \ln \kappa + 1)^2`. The paper ramps linearly in
  the number of turns :math:`r_i`; the code people run (the YaRN repository, Hugging Face, gpt-oss)
  ramps linearly in the pair index: ``yarn_frequencies(..., ramp="turns")`` and ``ramp="index"``.

PI and YaRN are followed by a short fine-tune at the longer length in their papers; these
functions give the frequencies, not a model that already uses them well.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from mha_lab.cpu.positions import Layout, rope_angles, rotate_pairs

__all__ = ["rope_frequencies", "interpolation_frequencies", "ntk_frequencies", "yarn_ramp_bounds",
           "yarn_frequencies", "yarn_attention_factor", "apply_rope_frequencies", "mean_rotary_score"]


def rope_frequencies(dim: int, base: float = 10000.0) -> np.ndarray:
    r"""RoPE's frequencies :math:`f_i = \theta^{-2i/d}` for i < d/2, in radians per position; shape (d/2,)."""
    return rope_angles(np.ones(1), dim, base)[0]


def _check_factor(factor: float) -> None:
    if factor < 1:
        raise ValueError(f"the context is stretched by factor >= 1, got {factor}")


def interpolation_frequencies(dim: int, factor: float, base: float = 10000.0) -> np.ndarray:
    r"""Position interpolation: :math:`\omega_i / \kappa`, i.e. position p is rotated as if it were p / kappa."""
    _check_factor(factor)
    return rope_frequencies(dim, base) / factor


def ntk_frequencies(dim: int, factor: float, base: float = 10000.0) -> np.ndarray:
    r"""NTK-aware scaling: the base becomes :math:`\theta\,s^{d/(d-2)}`; the last pair's frequency is divided by s."""
    _check_factor(factor)
    return rope_frequencies(dim, base * factor ** (dim / (dim - 2)))


def yarn_ramp_bounds(dim: int, original_len: int, base: float = 10000.0,
                     beta_fast: float = 32.0,
                     beta_slow: float = 1.0) -> tuple[float, float]:
    r"""Where the reference code's ramp starts and ends: the (fractional) pair index
    that turns ``beta_fast`` times over the training length, and ``beta_slow`` times.

    .. math:: i = \frac{d_k}{2}\,\frac{\ln\big(L_\text{train} / (2\pi\beta)\big)}
              {\ln\theta_\text{base}}
    """
    def pair(turns: float) -> float:  # r_i = L_train base^(-2i/d) / 2pi, for i
        return dim / 2 * math.log(original_len / (2 * math.pi * turns)) / math.log(base)

    return pair(beta_fast), pair(beta_slow)


def yarn_frequencies(dim: int, factor: float, original_len: int,
                     base: float = 10000.0, beta_fast: float = 32.0,
                     beta_slow: float = 1.0,
                     ramp: Literal["index", "turns"] = "index",
                     truncate: bool = False) -> np.ndarray:
    r"""YaRN's "NTK-by-parts" frequencies: pair i keeps a share gamma_i of its own.

    .. math:: \omega'_i = (1 - \gamma_i)\,\omega_i / \kappa + \gamma_i\,\omega_i

    ``ramp="index"`` (gpt-oss, Hugging Face, the YaRN repository): gamma_i falls
    linearly in the pair index i, from 1 at ``yarn_ramp_bounds``' low to 0 at its
    high. ``ramp="turns"`` (the paper's gamma(r)): gamma_i rises linearly in the
    turns r_i = L_train / lambda_i, from 0 at ``beta_slow`` to 1 at ``beta_fast``.
    Both keep the pairs that turn over ``beta_fast`` times and interpolate those
    under ``beta_slow``. ``truncate`` rounds low down and high up, as the YaRN
    repository and Hugging Face's default do; gpt-oss does not.
    """
    _check_factor(factor)
    w = rope_frequencies(dim, base)  # (d/2,): omega_i
    if ramp == "turns":
        turns = original_len * w / (2 * np.pi)  # (d/2,): r_i
        gamma = np.clip((turns - beta_slow) / (beta_fast - beta_slow), 0.0, 1.0)
    elif ramp == "index":
        low, high = yarn_ramp_bounds(dim, original_len, base, beta_fast, beta_slow)
        if truncate:
            low, high = max(math.floor(low), 0), min(math.ceil(high), dim - 1)
        high = max(high, low + 0.001)  # low == high: a step, not a division by zero
        gamma = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    else:
        raise ValueError(f"ramp must be 'index' (the reference code) or 'turns' "
                         f"(the paper), got {ramp!r}")
    return (1 - gamma) * w / factor + gamma * w


def yarn_attention_factor(factor: float) -> float:
    r"""YaRN's factor on q and k (so its square on the scores): :math:`\sqrt{1/t} = 0.1 \ln \kappa + 1`."""
    _check_factor(factor)
    return 0.1 * float(np.log(factor)) + 1.0


def apply_rope_frequencies(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray,
                           layout: Layout = "half") -> np.ndarray:
    """RoPE with the given frequencies on the first ``2 * len(freqs)`` coordinates; the rest pass unrotated.

    Partial rotary (GPT-NeoX rotates a quarter of each head) is ``freqs`` shorter than d/2. Pass the
    frequencies the model computes: GPT-NeoX computes them over the r rotated coordinates,
    ``rope_frequencies(r)``, i.e. :math:`\theta^{-2i/r}`, not the first r/2 of ``rope_frequencies(d)``.
    Shapes: x (..., L, d), positions (L,), freqs (r/2,) with r <= d even -> (..., L, d).
    """
    rot = 2 * len(freqs)
    if rot > x.shape[-1]:
        raise ValueError(f"{len(freqs)} frequencies rotate {rot} coordinates, more than the head's {x.shape[-1]}")
    angles = np.asarray(positions, dtype=np.float64)[:, None] * freqs  # (L, 1) * (r/2,) -> (L, r/2)
    out = np.array(x, dtype=np.float64)
    out[..., :rot] = rotate_pairs(x[..., :rot], angles, layout)
    return out


def mean_rotary_score(freqs: np.ndarray, distances: np.ndarray) -> np.ndarray:
    r"""The score of a vector of ones with itself ``distance`` positions apart, per coordinate pair.

    .. math:: \frac{1}{d/2} \sum_i \cos(f_i\,\Delta)

    1 at distance 0; how it falls and oscillates with distance is RoPE's long-range behaviour.
    Shapes: freqs (d/2,), distances (n,) -> (n,).
    """
    return np.cos(np.asarray(distances, dtype=np.float64)[:, None] * freqs).mean(axis=-1)
