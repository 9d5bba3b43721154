r"""The caches servers keep, as attention cores for ``ByteLM``: every query sees what a streaming cache holds.

A core receives the whole sequence at once (queries and keys rotated at positions 0..L-1) and
gives query t exactly what a cache would hold after token t was appended, so one forward pass
measures a stream decoded token by token. ``tests/test_model.py`` checks each against a plain
token-by-token cache.

- ``streaming_core(window, sinks)``: StreamingLLM's cache: the first ``sinks`` tokens and the
  last ``window``; positions are renumbered inside the cache (sink s at s, the newest token at
  sinks + window - 1), as StreamingLLM does, so no distance exceeds the cache's size.
- ``fake_quant_core(...)``: keys and values rounded as a uniformly quantised cache stores them
  (int8 with a scale per token, fp8 e4m3 with one scale per layer).
- ``kivi_core(bits, group, residual)``: KIVI (Liu et al. 2024) as tokens stream in: keys
  quantised per channel over groups of ``group`` tokens once ``residual`` of them have
  arrived, values per token once they are older than the newest ``residual``; the rest is the
  full-precision residual.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mha_lab.cpu.quantized import Axis, Format, quantize, quantize_groups
from mha_lab.cpu.window import sink_mask
from mha_lab.cuda.attention import causal_mask
from mha_lab.model.transformer import Core, Rope, attention_weights, rotate

__all__ = ["streaming_mask", "streaming_core", "fake_quant_core", "kivi_masks", "kivi_core",
           "kivi_bytes_per_token", "uniform_bytes_per_token"]


def _expand(q: torch.Tensor, *kv: torch.Tensor) -> list[torch.Tensor]:
    """K/V heads repeated for their query heads: (B, h_kv, L, d) -> (B, h, L, d)."""
    return [x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in kv]


def streaming_mask(L: int, window: int, sinks: int) -> torch.Tensor:
    """(L, L) boolean ``mha_lab.cpu.sink_mask``: query t holds key j when j <= t and (j < sinks or t - j < window)."""
    return torch.from_numpy(sink_mask(L, window, sinks)[0, 0] == 0)  # (1, 1, L, L) additive -> (L, L)


def streaming_core(window: int, sinks: int) -> Core:
    r"""StreamingLLM's cache of ``sinks`` first tokens and the last ``window``, positions renumbered.

    Query t sits at cache position :math:`P_t = \min(t, S + W - 1)`; a window key j at
    :math:`P_t - (t - j)`, so its score is the usual one; a sink s at s, so its score needs the
    query rotated at :math:`P_t`, i.e. turned back by :math:`t - P_t` from where it is.
    """
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink_logits: torch.Tensor | None,
             rope: Rope, **_: object) -> torch.Tensor:
        L, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
        k, v = _expand(q, k, v)
        scores = q @ k.transpose(-2, -1) * scale  # (B, h, L, L): window keys at their own distance
        if sinks:
            t = torch.arange(L)
            q_back = rotate(q, torch.clamp(t, max=sinks + window - 1) - t, rope.freqs)  # q at P_t
            scores[..., :sinks] = q_back @ k[..., :sinks, :].transpose(-2, -1) * scale  # (B, h, L, S)
        return attention_weights(scores, streaming_mask(L, window, sinks), sink_logits) @ v  # (B, h, L, d)
    return core


def _dequantized(x: torch.Tensor, fmt: Format, axis: Axis) -> torch.Tensor:
    return torch.from_numpy(quantize(x.numpy().astype(np.float64), fmt, axis).dequantize()).to(x.dtype)


def fake_quant_core(fmt: Format, axis: Axis) -> Core:
    """Causal attention over keys and values rounded by ``mha_lab.cpu.quantize(fmt, axis)``.

    ``axis="layer"`` is one scale for the layer's whole cache (every head and sequence of the
    batch), as vLLM keeps its fp8 k_scale and v_scale; here the scale is the cache's own absmax
    over 448, the best one scale can do.
    """
    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink_logits: torch.Tensor | None,
             **_: object) -> torch.Tensor:
        k, v = _expand(q, _dequantized(k, fmt, axis), _dequantized(v, fmt, axis))
        L = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return attention_weights(scores, causal_mask(L), sink_logits) @ v  # (B, h, L, d)
    return core


def kivi_masks(L: int, residual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, L) booleans: which keys and which values query t reads quantised in KIVI's streaming cache.

    Keys wait in the float16 residual until ``residual`` of them have arrived, then are quantised
    together: key j is quantised for query t when j < t + 1 - (t + 1) mod R. A value is quantised
    once it is older than the newest R: j < t + 1 - R.
    """
    t = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    return j < t + 1 - (t + 1) % residual, j < t + 1 - residual


def _group_quantized(x: torch.Tensor, bits: int, axis: str, group: int) -> torch.Tensor:
    return torch.from_numpy(quantize_groups(x.numpy().astype(np.float64), bits, axis, group).dequantize()).to(x.dtype)


def kivi_core(bits: int, group: int, residual: int) -> Core:
    """Causal attention as KIVI's cache gives it while tokens stream in (``mha_lab.cpu.kivi_quantize`` is the
    cache after a prompt): query t reads each key and value quantised or, in the residual, exact
    (``kivi_masks``). Keys per channel in groups of ``group`` tokens, values per token in groups of
    ``group`` channels (``quantize_groups``: a scale and a zero point per group)."""
    if residual % group:
        raise ValueError(f"the residual ({residual}) must be a multiple of the group ({group})")

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink_logits: torch.Tensor | None,
             **_: object) -> torch.Tensor:
        L = k.shape[-2]
        whole = L - L % group  # groups are fixed at multiples of G: quantise each once
        k_hat = k.clone()  # the tail of an incomplete group is never read quantised
        k_hat[..., :whole, :] = _group_quantized(k[..., :whole, :], bits, "channel", group)
        v_hat = _group_quantized(v, bits, "token", group)
        k, k_hat, v, v_hat = _expand(q, k, k_hat, v, v_hat)
        k_quant, v_quant = kivi_masks(L, residual)
        scale = 1 / math.sqrt(q.shape[-1])
        scores = torch.where(k_quant, q @ k_hat.transpose(-2, -1), q @ k.transpose(-2, -1)) * scale
        weights = attention_weights(scores, causal_mask(L), sink_logits)  # (B, h, L, L)
        # each weight multiplies the value query t reads: quantised or from the residual
        return (weights * v_quant) @ v_hat + (weights * ~v_quant) @ v  # (B, h, L, d)
    return core


def kivi_bytes_per_token(bits: int, group: int, num_kv_heads: int, head_dim: int) -> float:
    """KIVI's bytes per token and layer once past the residual, as ``quantize_groups`` stores them: codes,
    and a float16 scale and zero point per group, for one group of ``group`` tokens' keys and values."""
    block = np.zeros((1, num_kv_heads, group, head_dim))
    return sum(quantize_groups(block, bits, axis, group).nbytes for axis in ("channel", "token")) / group


def uniform_bytes_per_token(num_kv_heads: int, head_dim: int, per_token_scale: bool) -> float:
    """int8/fp8 cache bytes per token and layer: one byte a number, a float16 scale per token and head
    for K and V when ``per_token_scale`` (one per layer otherwise: nothing per token)."""
    return 2 * num_kv_heads * head_dim + (2 * 2 * num_kv_heads if per_token_scale else 0)

