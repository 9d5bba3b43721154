r"""A quantised KV cache: int8 and fp8 (e4m3) keys and values with scales, in NumPy.

Each stored number takes one byte instead of two (float16); a scale, kept in float16, maps it
back. Which numbers share a scale is the layout: one scale per **token** (a row of the
(T, d) cache of one head), per **channel** (a column), per **tensor** (one head of one sequence)
or per **layer** (every head and sequence of the cache: vLLM's fp8 ``k_scale`` and ``v_scale``).
A scale per channel over the whole cache needs every token before it can be computed; KIVI
therefore groups each channel's tokens ``G`` at a time (``kivi_quantize``).
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
           "LAYOUTS", "GroupQuantized", "quantize_groups", "kivi_quantize", "kivi_attention_error"]

Format = Literal["int8", "fp8"]
Axis = Literal["token", "channel", "tensor", "layer"]
Q_MAX = {"int8": 127.0, "fp8": 448.0}
SCALE_BYTES = 2  # scales are stored in float16
# the axes of a (..., T, d) cache that share one scale
_REDUCE = {"token": (-1,), "channel": (-2,), "tensor": (-2, -1), "layer": (-4, -3, -2, -1)}
# name -> (format, key scale axis, value scale axis)
LAYOUTS: dict[str, tuple[Format, Axis, Axis]] = {
    "int8, K per token, V per token": ("int8", "token", "token"),
    "int8, K per channel of the whole cache, V per token": ("int8", "channel", "token"),
    "fp8 e4m3, one scale per sequence and head": ("fp8", "tensor", "tensor"),
    "fp8 e4m3, one K and one V scale per layer (vLLM)": ("fp8", "layer", "layer"),
    "fp8 e4m3, K per channel of the whole cache, V per token": ("fp8", "channel", "token"),
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
    """Symmetric absmax quantisation of a (B, h, T, d) cache, one scale per ``axis`` (token, channel, tensor
    = sequence and head, layer = the whole cache)."""
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


def _output_error(q: np.ndarray, K: np.ndarray, V: np.ndarray, K_hat: np.ndarray, V_hat: np.ndarray) -> float:
    """||o_hat - o|| / ||o|| (Frobenius norms) of the attention output with K_hat, V_hat for K, V."""
    exact, _ = scaled_dot_product_attention(q, K, V, enable_gqa=True)
    approx, _ = scaled_dot_product_attention(q, K_hat, V_hat, enable_gqa=True)
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


def quantized_attention_error(q: np.ndarray, K: np.ndarray, V: np.ndarray, fmt: Format, key_axis: Axis,
                              value_axis: Axis) -> tuple[float, float]:
    """Bytes per cached token and relative error of the attention output with K and V quantised.

    Shapes: q (B, h, 1, d); K, V (B, h_kv, T, d). The error is ||o_q - o|| / ||o|| (Frobenius norms),
    with o the float output; the bytes are those of K and V as stored, scales included, per token
    of one sequence.
    """
    Kq, Vq = quantize(K, fmt, key_axis), quantize(V, fmt, value_axis)
    per_token = (Kq.nbytes + Vq.nbytes) / (K.shape[0] * K.shape[2])
    return per_token, _output_error(q, K, V, Kq.dequantize(), Vq.dequantize())


@dataclass(frozen=True)
class GroupQuantized:
    """Asymmetric codes of ``bits`` bits with a float16 scale and zero point per group.

    ``codes`` are kept grouped, (..., T/G, G, d) or (..., T, d/G, G), with ``scale`` and ``zero``
    reduced to 1 along the group; ``dequantize`` returns the cache's ``shape``.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    bits: int
    shape: tuple[int, ...]

    def dequantize(self) -> np.ndarray:
        return (self.codes * self.scale + self.zero).reshape(self.shape)

    @property
    def nbytes(self) -> float:
        """Bytes as stored: ``bits`` per code, ``SCALE_BYTES`` per scale and per zero point."""
        return self.codes.size * self.bits / 8 + SCALE_BYTES * (self.scale.size + self.zero.size)


def quantize_groups(x: np.ndarray, bits: int, axis: Literal["token", "channel"], group: int) -> GroupQuantized:
    r"""KIVI's asymmetric quantisation of a (..., T, d) cache in groups of ``group`` numbers.

    ``axis="channel"``: each channel's tokens, ``group`` at a time (keys; T a multiple of it);
    ``axis="token"``: each token's channels, ``group`` at a time (values; d a multiple of it).

    .. math:: z = \min x, \quad \Delta = \frac{\max x - \min x}{2^{b} - 1}, \quad
              q = \mathrm{round}\Big(\frac{x - z}{\Delta}\Big), \quad \hat x = \Delta q + z
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    if axis not in ("token", "channel"):
        raise ValueError(f"axis must be 'token' or 'channel', got {axis!r}")
    n = x.shape[-2] if axis == "channel" else x.shape[-1]
    if group < 1 or n % group:
        raise ValueError(f"a group of {group} must divide the {n} {'tokens' if axis == 'channel' else 'channels'}")
    if axis == "channel":  # (..., T, d) -> (..., T/G, G, d): a scale per channel and group of tokens
        g, reduce = x.reshape(*x.shape[:-2], n // group, group, x.shape[-1]), -2
    else:  # (..., T, d) -> (..., T, d/G, G): a scale per token and group of channels
        g, reduce = x.reshape(*x.shape[:-1], n // group, group), -1
    zero = g.min(axis=reduce, keepdims=True)
    span = g.max(axis=reduce, keepdims=True) - zero
    scale = np.where(span > 0, span / (2**bits - 1), 1.0)
    codes = np.clip(np.round((g - zero) / scale), 0, 2**bits - 1).astype(np.uint8)
    return GroupQuantized(codes, scale, zero, bits, x.shape)


def kivi_quantize(K: np.ndarray, V: np.ndarray, bits: int = 2, group: int = 32,
                  residual: int = 128) -> tuple[np.ndarray, np.ndarray, float]:
    """A (B, h_kv, T, d) cache as KIVI (Liu et al. 2024, Algorithm 1) holds it after a prompt of T tokens.

    Keys per channel in groups of ``group`` tokens, except the last T mod ``residual``, kept in float16
    until ``residual`` of them have arrived; values per token in groups of ``group`` channels, except
    the last ``residual`` tokens, kept in float16. Returns the dequantised K and V and the bytes stored.
    """
    if residual % group:
        raise ValueError(f"the residual ({residual}) must be a multiple of the group ({group})")
    T = K.shape[-2]
    k_q = T - T % residual  # keys quantised so far: whole residuals, so whole groups
    v_q = max(T - residual, 0)  # values: all but the last `residual` tokens
    K_hat, V_hat, stored = K.copy(), V.copy(), SCALE_BYTES * (K[..., k_q:, :].size + V[..., v_q:, :].size)
    if k_q:
        Kq = quantize_groups(K[..., :k_q, :], bits, "channel", group)
        K_hat[..., :k_q, :], stored = Kq.dequantize(), stored + Kq.nbytes
    if v_q:
        Vq = quantize_groups(V[..., :v_q, :], bits, "token", group)
        V_hat[..., :v_q, :], stored = Vq.dequantize(), stored + Vq.nbytes
    return K_hat, V_hat, stored


def kivi_attention_error(q: np.ndarray, K: np.ndarray, V: np.ndarray, bits: int = 2, group: int = 32,
                         residual: int = 128) -> tuple[float, float]:
    """``quantized_attention_error`` for ``kivi_quantize``: bytes per cached token of one sequence (codes, scales,
    zero points and the float16 residual) and the relative error of the attention output."""
    K_hat, V_hat, stored = kivi_quantize(K, V, bits, group, residual)
    return stored / (K.shape[0] * K.shape[2]), _output_error(q, K, V, K_hat, V_hat)


def keys_with_outliers(shape: tuple[int, ...], outlier_channels: list[int], magnitude: float,
                       seed: int = 0) -> np.ndarray:
    """Standard normal keys (..., T, d) whose ``outlier_channels`` are ``magnitude`` times larger.

    Trained models' keys have such channels (KIVI, KVQuant); these stand in for them.
    """
    K = np.random.default_rng(seed).standard_normal(shape)
    K[..., outlier_channels] *= magnitude
    return K
