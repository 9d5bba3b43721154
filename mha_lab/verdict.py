"""Words from measurements: the verdicts the book prints next to its numbers.

A sentence such as "the loop is slower" must follow the timing printed beside it, on every
machine that builds the book. So the words are computed here from the measured values and a
stated margin: a difference inside the margin is reported as none, a difference outside it by
its size and direction. The margin is part of the sentence ("within 25%"), so the reader sees
how large a difference has to be before the book calls it one.
"""

from __future__ import annotations

__all__ = ["TIMING_NOISE", "TIMING_MARGIN", "relation", "speed", "closeness", "slope"]

TIMING_NOISE = 0.10
"""How far one timing may be off, either way, on a busy machine (a relative error)."""

TIMING_MARGIN = 0.25
"""The margin for a ratio of two timings: with each off by up to ``TIMING_NOISE``, their ratio is off by
up to (1 + 0.1) / (1 - 0.1) - 1 = 22%. A verdict outside this margin cannot be the opposite of the truth."""


def relation(value: float, reference: float, margin: float) -> int:
    r"""+1 if ``value`` is above ``reference`` by more than the relative ``margin``, -1 if below, 0 if within.

    Within means :math:`|\text{value}/\text{reference} - 1| \le \text{margin}`.
    """
    if margin < 0:
        raise ValueError(f"margin must be non-negative, got {margin}")
    if reference <= 0 or value < 0:
        raise ValueError(f"relation compares a non-negative value with a positive reference, got {value} "
                         f"and {reference}")
    ratio = value / reference
    if ratio > 1 + margin:
        return 1
    if ratio < 1 - margin:
        return -1
    return 0


def _factor(ratio: float) -> str:
    """A ratio to two significant digits without an exponent: 1.3, 12, 120."""
    return f"{float(f'{ratio:.2g}'):g}"


def speed(name: str, seconds: float, ref_name: str, ref_seconds: float,
          margin: float = TIMING_MARGIN) -> str:
    """A clause comparing two measured times: "<name> is 1.3x slower than <ref_name>", "... 1.3x
    faster than ...", or "<name> and <ref_name> take the same time within 25%"."""
    sign = relation(seconds, ref_seconds, margin)
    if sign > 0:
        return f"{name} is {_factor(seconds / ref_seconds)}x slower than {ref_name}"
    if sign < 0:
        return f"{name} is {_factor(ref_seconds / seconds)}x faster than {ref_name}"
    return f"{name} and {ref_name} take the same time within {margin:.0%}"


def closeness(value: float, reference: float, margin: float = TIMING_MARGIN) -> str:
    """How a measured ``value`` stands to an expected ``reference``: "within 25% of", "33% above" or
    "30% below", to be followed by the reference ("... the counted 3")."""
    sign = relation(value, reference, margin)
    if sign == 0:
        return f"within {margin:.0%} of"
    return f"{abs(value / reference - 1):.0%} {'above' if sign > 0 else 'below'}"


def slope(measured: float, model: float, margin: float = 0.1) -> str:
    """A fitted log-log slope against the slope a cost model has over the same points: "as steep
    as", "steeper than" or "shallower than" (absolute ``margin`` on the slope)."""
    if margin < 0:
        raise ValueError(f"margin must be non-negative, got {margin}")
    if measured > model + margin:
        return "steeper than"
    if measured < model - margin:
        return "shallower than"
    return f"as steep as (within {margin:g} of)"
