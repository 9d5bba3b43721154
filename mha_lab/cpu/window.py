r"""Bounding the cache: attention sinks (StreamingLLM) and gpt-oss's learned sink logit, in NumPy.

A sliding window (``create_causal_mask(..., window=W)`` and a windowed ``KVCache``) keeps the
last W keys. Xiao et al. (2023) found that trained models park much of their attention on the
first few tokens, whatever they say; evicting them breaks the model. **StreamingLLM** keeps
those ``sinks`` first tokens forever, plus the window: ``sink_mask`` and ``SinkKVCache``.

gpt-oss (OpenAI 2025) gives each head a learned **sink logit** instead: one more column of
scores, the same for every query, that takes part in the softmax and is then dropped, so
a head may attend to nothing. With logit 0 this is the "softmax plus one",
:math:`e^{s_j} / (1 + \sum_k e^{s_k})`.
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.decode import KVCache
from mha_lab.cpu.functional import create_causal_mask, repeat_kv, softmax

__all__ = ["sink_mask", "SinkKVCache", "attention_with_sink"]


def sink_mask(seq_len: int, window: int, sinks: int) -> np.ndarray:
    """Additive causal mask (1, 1, L, L): query i sees keys i - W < j <= i and the first ``sinks`` keys j <= i."""
    if sinks < 0:
        raise ValueError(f"sinks must be at least 0, got {sinks}")
    mask = create_causal_mask(seq_len, window=window)  # (1, 1, L, L)
    mask[..., :sinks] = create_causal_mask(seq_len)[..., :sinks]  # the sink columns: causal only
    return mask


class SinkKVCache(KVCache):
    """A cache that keeps the first ``sinks`` positions and a rolling window of the last ``window``.

    Position p < sinks lives in slot p; a later position in slot ``sinks + (p - sinks) % window``,
    evicting the one ``window`` positions back. ``decode_step`` runs on it unchanged: it
    attends over the filled slots, in slot order. Positions stay absolute (a RoPE layer
    rotates each key at its own position); StreamingLLM itself renumbers positions inside
    the cache. Tokens enter one at a time, through ``decode_step``.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, window: int, sinks: int,
                 dtype: np.dtype | type = np.float64) -> None:
        if sinks < 0:
            raise ValueError(f"sinks must be at least 0, got {sinks}")
        super().__init__(batch_size, num_kv_heads, head_dim, max_len=sinks + window, dtype=dtype)
        self.sinks, self.window_size = sinks, window

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Write one new position, each (B, h_kv, 1, d_k), evicting the oldest non-sink one when full."""
        if k.shape[2] != 1:
            raise ValueError(f"a SinkKVCache takes one position at a time, got {k.shape[2]}; "
                             "feed a prompt through decode_step token by token")
        p = self.length
        slot = p if p < self.capacity else self.sinks + (p - self.sinks) % self.window_size
        self.k[:, :, slot], self.v[:, :, slot] = k[:, :, 0], v[:, :, 0]
        self.length += 1


def attention_with_sink(
    Q: np.ndarray, K: np.ndarray, V: np.ndarray, sink_logits: np.ndarray,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    r"""Attention with one more softmax column per head, the learned logit b_i.

    .. math:: A_{mn} = \frac{e^{s_{mn}}}{e^{b_i} + \sum_k e^{s_{mk}}}

    Shapes: Q (B, h, L_q, d); K, V (B, h_kv, L_k, d), h % h_kv == 0;
    sink_logits (h,); mask additive, broadcastable to (B, h, L_q, L_k).
    Returns the output (B, h, L_q, d) and the weights (B, h, L_q, L_k),
    whose rows sum to less than 1: the sink column is dropped.
    """
    h = Q.shape[1]
    if np.shape(sink_logits) != (h,):
        raise ValueError(f"sink_logits must have one logit per query head, "
                         f"shape ({h},), got {np.shape(sink_logits)}")
    n_rep = h // K.shape[1]
    K, V = repeat_kv(K, n_rep), repeat_kv(V, n_rep)  # (B, h, L_k, d)
    # (B, h, L_q, L_k)
    scores = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    b = np.asarray(sink_logits, float)[None, :, None, None]  # (1, h, 1, 1)
    sink = np.broadcast_to(b, scores.shape[:3] + (1,))  # (B, h, L_q, 1)
    # (B, h, L_q, L_k + 1): the sink column joins the softmax, then is dropped
    weights = softmax(np.concatenate([scores, sink], axis=-1))[..., :-1]
    return weights @ V, weights
