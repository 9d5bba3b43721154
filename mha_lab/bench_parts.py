"""The fused forward timed part by part, for the ``parts`` section of ``python -m mha_lab bench``.

``ForwardParts`` runs an unmasked ``MultiHeadAttention`` forward once as its four parts (the
projections, the scores, the softmax, the weighted values) and hands each part back as a call of
its own; ``forward_part_flops`` gives each part its share of ``count_flops``, so that the GFLOP/s
of a projection and of a softmax can be told apart; ``part_shares`` reads the timed parts back as
shares of the FLOPs and of the time, and ``fixed_rate_seconds`` predicts the forward's time if every
part kept a given rate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_lab.analysis import flops_breakdown
from mha_lab.cpu import MultiHeadAttention, softmax

__all__ = ["FORWARD_PARTS", "forward_part_flops", "fixed_rate_seconds", "ForwardParts", "part_shares"]

FORWARD_PARTS: dict[str, tuple[str, ...]] = {
    "projections": ("proj_q", "proj_kv", "proj_o"),
    "scores": ("qk",),
    "softmax": ("softmax",),
    "weighted values": ("av",),
}
"""The parts of the fused forward, each with the ``flops_breakdown`` terms it computes."""


def forward_part_flops(B: int, L: int, d_model: int, h: int) -> dict[str, int]:
    """Each part's FLOPs in the convention of ``count_flops`` (they add up to it), keyed like ``FORWARD_PARTS``."""
    terms = flops_breakdown(B, L, d_model, h)
    return {part: sum(terms[t] for t in names) for part, names in FORWARD_PARTS.items()}


def fixed_rate_seconds(gflops: dict[str, float], B: int, L: int, d_model: int, h: int) -> float:
    r"""The forward's time at length ``L`` if each part ran at the given GFLOP/s: :math:`\sum_p F_p(L) / r_p`."""
    return sum(f / (gflops[part] * 1e9) for part, f in forward_part_flops(B, L, d_model, h).items())


def _scores(Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """The raw scores, a fresh array as in the forward: (B, h, L, d_k) @ (B, h, d_k, L) -> (B, h, L, L)."""
    return Q @ K.swapaxes(-1, -2)


def _weights(S: np.ndarray, d_k: int) -> np.ndarray:
    r"""The attention weights :math:`\mathrm{softmax}(S/\sqrt{d_k})`, in place in ``S`` as in the forward."""
    S *= 1.0 / np.sqrt(d_k)
    return softmax(S, out=S)


class ForwardParts:
    r"""The forward of an unmasked ``MultiHeadAttention``, run once as its parts in order.

    projections :math:`Q, K, V = XW_{Q,K,V}` and :math:`\text{out} = ZW_O`; scores :math:`S = QK^\top`;
    softmax :math:`A = \mathrm{softmax}(S/\sqrt{d_k})`; weighted values :math:`Z = AV`. ``flops`` gives each
    part's share of ``count_flops``; ``calls`` each part on its own, for timing.
    Shapes: X, out: (B, L, d_model); Q, K, V, Z: (B, h, L, d_k); A: (B, h, L, L).
    """

    def __init__(self, layer: MultiHeadAttention, X: np.ndarray) -> None:
        self.layer, self.X = layer, layer.check_input(X)
        self.flops = forward_part_flops(*self.X.shape, layer.num_heads)
        self.Q, self.K, self.V = layer.project_qkv(self.X)
        self.A = _weights(_scores(self.Q, self.K), layer.d_k)
        self.Z = self.A @ self.V  # (B, h, L, L) @ (B, h, L, d_k) -> (B, h, L, d_k)
        self.out = layer.project_out(self.Z)

    def calls(self) -> dict[str, Callable[[], object]]:
        """Each part as a no-argument call on the intermediates of the run, keyed like ``FORWARD_PARTS``.

        The softmax works in place, as in the forward, on a copy of A: each call runs on the last
        call's output, the same work per element.
        """
        layer, scratch = self.layer, self.A.copy()
        return {"projections": lambda: (layer.project_qkv(self.X), layer.project_out(self.Z)),
                "scores": lambda: _scores(self.Q, self.K),
                "softmax": lambda: _weights(scratch, layer.d_k),
                "weighted values": lambda: self.A @ self.V}


def part_shares(rows: list[dict]) -> dict[str, dict[str, float]]:
    """The timed parts of one shape (benchmark rows with ``impl``, ``flops``, ``seconds`` and ``gflops``), by
    part: its share of the FLOPs, its share of the parts' time, its GFLOP/s."""
    flops, seconds = sum(r["flops"] for r in rows), sum(r["seconds"] for r in rows)
    return {r["impl"]: {"flops_share": r["flops"] / flops, "time_share": r["seconds"] / seconds,
                        "gflops": r["gflops"]} for r in rows}
