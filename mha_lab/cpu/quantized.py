r"""A quantised KV cache: int8 and fp8 (e4m3) keys and values with scales, in NumPy.

Each stored number takes one byte instead of two (float16); a scale, kept in float16, maps it
back. Which numbers share a scale is the layout: one scale per **token** (a row of the
(T, d) cache of one head), per **channel** (a column) or per **tensor** (the whole head).
Keys have a few channels far larger than the rest (outlier channels); a per-token scale is
set by the outlier, and rounds every other channel of that token to a few levels. KIVI (Liu et
al. 2024) therefore quantises keys per channel and values per token; KVQuant (Hooper et al.
2024) quantises keys per channel *before* RoPE, which would otherwise rotate each outlier
channel into its pair.

Symmetric absmax quantisation, with :math:`q_{\max}` = 127 (int8) or 448 (e4m3):

.. math:: s = \frac{\max |x|}{q_{\max}}, \quad q = \mathrm{round}(x / s), \quad \hat x = s\,q

fp8 is emulated: ``round_e4m3`` rounds float64 to the nearest e4m3 value (4 exponent bits,
bias 7, 3 mantissa bits, largest 448, no infinities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from mha_lab.cpu.functional import scaled_dot_product_attention

__all__ = ["round_e4m3", "Quantized", "quantize", "quantized_attention_error", "keys_with_outliers",
           "LAYOUTS"]

Format = Literal["int8", "fp8"]
Axis = Literal["token", "channel", "tensor"]
Q_MAX = {"int8": 127.0, "fp8": 448.0}
SCALE_BYTES = 2  # scales are stored in float16
# the axes of a (..., T, d) cache that share one scale
_REDUCE = {"token": (-1,), "channel": (-2,), "tensor": (-2, -1)}
# name -> (format, key scale axis, value scale axis)
LAYOUTS: dict[str, tuple[Format, Axis, Axis]] = {
    "int8, K per token, V per token": ("int8", "token", "token"),
    "int8, K per channel, V per token (KIVI)": ("int8", "channel", "token"),
    "fp8 e4m3, K per tensor, V per tensor": ("fp8", "tensor", "tensor"),
    "fp8 e4m3, K per channel, V per token": ("fp8", "channel", "token"),
}


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to the nearest fp8 e4m3 value (ties to even), saturating at +-448; returned as float64."""
    x = np.clip(np.asarray(x, dtype=np.float64), -448.0, 448.0)
    # the binade of each value; below 2^-6 the spacing is the subnormals' 2^-9
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -6)))
    step = 2.0 ** (e - 3)  # 3 mantissa bits: 8 values per binade
    return np.clip(np.round(x / step) * step, -448.0, 448.0)


@dataclass(frozen=True)
class Quantized:
    """Codes and their scales: ``codes * scale`` is the dequantised tensor.

    ``codes`` are int8, or float64 holding e4m3 values (one byte each when stored); ``scale``
    has the shape of the tensor with the shared axes reduced to 1.
    """

    codes: np.ndarray
    scale: np.ndarray
    fmt: Format

    def dequantize(self) -> np.ndarray:
        return self.codes * self.scale

    @property
    def nbytes(self) -> int:
        """Bytes as stored: one per code, ``SCALE_BYTES`` per scale."""
        return self.codes.size + SCALE_BYTES * self.scale.size

    def error_bound(self) -> np.ndarray:
        """The largest error rounding may make on each element: half a step of its code.

        int8: s/2. e4m3: half the spacing of the binade the code lies in (at least 2^-10 s).
        """
        if self.fmt == "int8":
            return np.broadcast_to(self.scale / 2, self.codes.shape)
        e = np.floor(np.log2(np.maximum(np.abs(self.codes), 2.0 ** -6)))
        return 2.0 ** (e - 4) * self.scale


def quantize(x: np.ndarray, fmt: Format, axis: Axis) -> Quantized:
    """Symmetric absmax quantisation of a (..., T, d) cache, one scale per ``axis`` (token, channel, tensor)."""
    if fmt not in Q_MAX or axis not in _REDUCE:
        raise ValueError(f"fmt must be one of {sorted(Q_MAX)} and axis one of {sorted(_REDUCE)}, "
                         f"got {fmt!r} and {axis!r}")
    amax = np.abs(x).max(axis=_REDUCE[axis], keepdims=True)
    scale = np.where(amax > 0, amax / Q_MAX[fmt], 1.0)
    if fmt == "int8":
        codes = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
    else:
        codes = round_e4m3(x / scale)
    return Quantized(codes, scale, fmt)


def quantized_attention_error(q: np.ndarray, K: np.ndarray, V: np.ndarray, fmt: Format, key_axis: Axis,
                              value_axis: Axis) -> tuple[float, float]:
    """Bytes per cached token and relative error of the attention output with K and V quantised.

    Shapes: q (B, h, 1, d); K, V (B, h_kv, T, d). The error is ||o_q - o|| / ||o|| (Frobenius norms),
    with o the float output; the bytes are those of K and V as stored, scales included, per token
    of one sequence.
    """
    Kq, Vq = quantize(K, fmt, key_axis), quantize(V, fmt, value_axis)
    exact, _ = scaled_dot_product_attention(q, K, V, enable_gqa=True)
    approx, _ = scaled_dot_product_attention(q, Kq.dequantize(), Vq.dequantize(), enable_gqa=True)
    per_token = (Kq.nbytes + Vq.nbytes) / (K.shape[0] * K.shape[2])
    return per_token, float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


def keys_with_outliers(shape: tuple[int, ...], outlier_channels: list[int], magnitude: float,
                       seed: int = 0) -> np.ndarray:
    """Standard normal keys (..., T, d) whose ``outlier_channels`` are ``magnitude`` times larger.

    Trained models' keys have such channels (KIVI, KVQuant); these stand in for them.
    """
    K = np.random.default_rng(seed).standard_normal(shape)
    K[..., outlier_channels] *= magnitude
    return K
