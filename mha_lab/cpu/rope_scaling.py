r"""RoPE past its training length: the base, position interpolation, NTK-aware scaling, YaRN, partial rotary.

RoPE rotates pair i of a head by :math:`p\,f_i` with frequencies :math:`f_i = \theta^{-2i/d}`,
i < d/2. Pair i turns once every :math:`\lambda_i = 2\pi / f_i` positions. A model trained on
L positions has seen the slow pairs turn through only part of a circle; at a longer context
they reach angles it never saw. Each method below changes the frequencies so that a context
s times longer (``factor`` s) stays within what was trained:

- a larger base :math:`\theta` (Llama 3: 500,000 instead of 10,000) slows every pair;
- position interpolation (Chen et al. 2023) divides every frequency by s;
- NTK-aware scaling raises the base to :math:`\theta\,s^{d/(d-2)}`: the fastest pair keeps its
  frequency, the slowest is divided by s;
- YaRN (Peng et al. 2023) interpolates only the pairs that turn less than
  :math:`\alpha` times over L, keeps those that turn more than :math:`\beta` times, ramps in
  between, and sharpens the softmax by :math:`(0.1 \ln s + 1)^2`.
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.positions import Layout, rope_angles, rotate_pairs

__all__ = ["rope_frequencies", "interpolation_frequencies", "ntk_frequencies", "yarn_frequencies",
           "yarn_attention_factor", "apply_rope_frequencies", "mean_rotary_score"]


def rope_frequencies(dim: int, base: float = 10000.0) -> np.ndarray:
    r"""RoPE's frequencies :math:`f_i = \theta^{-2i/d}` for i < d/2, in radians per position; shape (d/2,)."""
    return rope_angles(np.ones(1), dim, base)[0]


def _check_factor(factor: float) -> None:
    if factor < 1:
        raise ValueError(f"the context is stretched by factor >= 1, got {factor}")


def interpolation_frequencies(dim: int, factor: float, base: float = 10000.0) -> np.ndarray:
    r"""Position interpolation: :math:`f_i / s`, i.e. position p is rotated as if it were p / s."""
    _check_factor(factor)
    return rope_frequencies(dim, base) / factor


def ntk_frequencies(dim: int, factor: float, base: float = 10000.0) -> np.ndarray:
    r"""NTK-aware scaling: the base becomes :math:`\theta\,s^{d/(d-2)}`; the last pair's frequency is divided by s."""
    _check_factor(factor)
    return rope_frequencies(dim, base * factor ** (dim / (dim - 2)))


def yarn_frequencies(dim: int, factor: float, original_len: int,
                     base: float = 10000.0, alpha: float = 1.0,
                     beta: float = 32.0) -> np.ndarray:
    r"""YaRN's "NTK-by-parts" frequencies.

    .. math:: r_i = \frac{L}{\lambda_i}, \quad
              \gamma_i = \mathrm{clip}\Big(\frac{r_i - \alpha}{\beta - \alpha},
              0, 1\Big), \quad
              f'_i = (1 - \gamma_i)\,\frac{f_i}{s} + \gamma_i\, f_i

    ``original_len`` is the training length L; :math:`r_i` is how many
    turns pair i makes over it.
    """
    _check_factor(factor)
    f = rope_frequencies(dim, base)
    turns = original_len * f / (2 * np.pi)
    gamma = np.clip((turns - alpha) / (beta - alpha), 0.0, 1.0)
    return (1 - gamma) * f / factor + gamma * f


def yarn_attention_factor(factor: float) -> float:
    r"""YaRN's factor on q and k (so its square on the scores): :math:`\sqrt{1/t} = 0.1 \ln s + 1`."""
    _check_factor(factor)
    return 0.1 * float(np.log(factor)) + 1.0


def apply_rope_frequencies(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray,
                           layout: Layout = "half") -> np.ndarray:
    """RoPE with the given frequencies on the first ``2 * len(freqs)`` coordinates; the rest pass unrotated.

    Partial rotary (GPT-NeoX rotates a quarter of each head) is ``freqs`` shorter than d/2.
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
