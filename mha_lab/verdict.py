"""Words from measurements: the verdicts the book prints next to its numbers.

A sentence such as "the loop is slower" must follow the timing printed beside it, on every
machine that builds the book. So the words are computed here from the measured values and a
stated margin: a difference inside the margin is reported as none, a difference outside it by
its size and direction. The margin is part of the sentence ("within 25%"), so the reader sees
how large a difference has to be before the book calls it one.

The chapters derive their margins from the build itself, by one rule (``paired_margin``): the
readings of the two things compared are taken in rounds, interleaved (``mha_lab.measure.fastest_runs``),
so each round gives a pair that shares the machine's load of that moment; the margin is the spread of
the per-pair ratios. Where that margin is above ``NOISY_MARGIN`` the verdicts say ``TOO_NOISY`` and the
chapters draw no explanation from the numbers. ``TIMING_MARGIN`` is only the default where nothing was
measured (the command line, the tests). A comparison that is not a timing (an intensity from a
spec sheet against a ridge point) states a threshold of its own (``ROOFLINE_BAND``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["TIMING_NOISE", "TIMING_MARGIN", "MIN_MARGIN", "NOISY_MARGIN", "TOO_NOISY", "ROOFLINE_BAND", "spread",
           "paired_margin", "too_noisy", "relation", "speed", "closeness", "slope", "slope_steps", "rate_changes",
           "cache_fit", "agreement", "two_digits", "whole_or_two_digits", "listing", "closeness_each", "roofline"]

TIMING_NOISE = 0.10
"""How far one timing may be off, either way, on a busy machine (a relative error)."""

TIMING_MARGIN = 0.25
"""The default margin for a ratio of two timings: with each off by up to ``TIMING_NOISE``, their ratio is off by
up to (1 + 0.1) / (1 - 0.1) - 1 = 22%. A verdict outside this margin cannot be the opposite of the truth."""

MIN_MARGIN = 0.05
"""The smallest margin ``paired_margin`` gives: a few pairs whose ratios happen to agree closely do not show that
the next pair's will."""

NOISY_MARGIN = 0.5
"""Above this margin the readings say nothing worth a sentence: a pair's ratio that wanders by more than half
cannot tell a difference of 1.5 times from none. The verdicts then say ``TOO_NOISY``."""

TOO_NOISY = "too noisy on this build to say"

ROOFLINE_BAND = 1.0
"""How near a ridge point an intensity from a spec sheet (no timing) counts as "neither bound dominates": within a
factor of 1 + 1.0 = 2 either way. At an intensity I against a ridge R, the arithmetic takes I/R times as long as
the reads; a bound dominates when its time is more than twice the other's."""


def spread(readings: Sequence[float]) -> float:
    """How far repeated readings of one timing wander: the largest over the smallest, less one (0.2 is 20%)."""
    if len(readings) < 2 or min(readings) <= 0:
        raise ValueError(f"spread needs at least two positive readings, got {list(readings)}")
    return max(readings) / min(readings) - 1


def paired_margin(readings: Sequence[float], references: Sequence[float], floor: float = MIN_MARGIN) -> float:
    """The margin for the ratio of two quantities read in pairs (round r reads both, interleaved): the spread of the
    per-pair ratios a_r / b_r, never below ``floor``.

    Load that slows a whole round slows both readings of its pair and cancels in their ratio, so the pairs agree
    far better than either series does with itself (multiplying the two series' spreads would count that load
    twice). Rates work the same way: pass the two rates of each round."""
    if len(readings) != len(references):
        raise ValueError(f"paired readings need one reference per reading, got {len(readings)} and "
                         f"{len(references)}")
    if min(references, default=0) <= 0:
        raise ValueError(f"paired readings need positive references, got {list(references)}")
    return max(floor, spread([a / b for a, b in zip(readings, references, strict=True)]))


def too_noisy(margin: float) -> bool:
    """Whether a measured margin is above ``NOISY_MARGIN``: then no verdict and no explanation is drawn from it."""
    return margin > NOISY_MARGIN


def relation(value: float, reference: float, margin: float) -> int:
    r"""+1 if ``value`` is above ``reference`` by more than the relative ``margin``, -1 if below, 0 if within.

    Within means :math:`1/(1 + \text{margin}) \le \text{value}/\text{reference} \le 1 + \text{margin}`: a margin
    is a factor either way, as ``paired_margin`` derives it, so a margin above 100% still leaves room below.
    """
    if margin < 0:
        raise ValueError(f"margin must be non-negative, got {margin}")
    if reference <= 0 or value < 0:
        raise ValueError(f"relation compares a non-negative value with a positive reference, got {value} "
                         f"and {reference}")
    ratio = value / reference
    if ratio > 1 + margin:
        return 1
    if ratio < 1 / (1 + margin):
        return -1
    return 0


def two_digits(x: float) -> str:
    """A ratio or a rate to two significant digits without an exponent, as the verdicts print them: 1.3, 12, 120."""
    return f"{float(f'{x:.2g}'):g}"


def whole_or_two_digits(x: float) -> str:
    """A figure as the prose prints it: whole from 100 on (242, 29,199), else two significant digits (0.5, 16)."""
    return f"{x:,.0f}" if abs(x) >= 100 else two_digits(x)


def speed(name: str, seconds: float, ref_name: str, ref_seconds: float,
          margin: float = TIMING_MARGIN) -> str:
    """A clause comparing two measured times: "<name> is 1.3 times slower than <ref_name>", "... 1.3 times
    faster than ...", or "<name> and <ref_name> show no measurable difference on this machine (within 25%)"; above
    ``NOISY_MARGIN``: "the comparison of <name> with <ref_name> is too noisy on this build to say (...)"."""
    if too_noisy(margin):
        return f"the comparison of {name} with {ref_name} is {TOO_NOISY} (paired readings {margin:.0%} apart)"
    sign = relation(seconds, ref_seconds, margin)
    if sign > 0:
        return f"{name} is {two_digits(seconds / ref_seconds)} times slower than {ref_name}"
    if sign < 0:
        return f"{name} is {two_digits(ref_seconds / seconds)} times faster than {ref_name}"
    return f"{name} and {ref_name} show no measurable difference on this machine (within {margin:.0%})"


def closeness(value: float, reference: float, margin: float = TIMING_MARGIN) -> str:
    """How a measured ``value`` stands to an expected ``reference``: "within 25% of", "33% above" or
    "30% below", to be followed by the reference ("... the counted 3"); above ``NOISY_MARGIN``: "too noisy on this
    build to say how near it lies to"."""
    if too_noisy(margin):
        return f"{TOO_NOISY} how near it lies to"
    sign = relation(value, reference, margin)
    if sign == 0:
        return f"within {margin:.0%} of"
    return f"{abs(value / reference - 1):.0%} {'above' if sign > 0 else 'below'}"


def closeness_each(values: Sequence[float], reference: float, margin: float = TIMING_MARGIN) -> str:
    """``closeness`` of several values to one reference, said once where they agree: "within 25% of",
    "53% and 57% below"; else each in turn: "within 25% of and 30% above"."""
    words = [closeness(v, reference, margin) for v in values]
    if len(set(words)) == 1:  # also when too noisy: closeness then says the same of every value
        return words[0]
    signs = {relation(v, reference, margin) for v in values}
    if signs in ({1}, {-1}):  # all above or all below: the direction once
        return f"{listing([f'{abs(v / reference - 1):.0%}' for v in values])} {'above' if signs == {1} else 'below'}"
    return listing(words)


def slope(measured: float, model: float, margin: float = 0.1) -> str:
    """A fitted log-log slope against the slope a cost model has over the same points: "as steep
    as", "steeper than" or "shallower than" (absolute ``margin`` on the slope, stated once by the caller)."""
    if margin < 0:
        raise ValueError(f"margin must be non-negative, got {margin}")
    if measured > model + margin:
        return "steeper than"
    if measured < model - margin:
        return "shallower than"
    return "as steep as"


def slope_steps(counted: float, at_fixed_rates: float, measured: float, margin: float = 0.1) -> str:
    """Why a measured log-log slope is not a FLOP count's, in two steps judged by ``slope`` (absolute
    ``margin``): from the count's slope to ``at_fixed_rates``, the slope of the time the count's FLOPs would
    take if each part of the work kept its rate from the shortest length (the parts' different rates),
    then from there to the measured slope (the rates changing with length)."""
    first, second = slope(at_fixed_rates, counted, margin), slope(measured, at_fixed_rates, margin)
    grow = "the parts that grow fastest are the {} ones"
    rate = "the work does {} FLOPs per second at the longest length than at the shortest"
    why_first = {"steeper than": grow.format("slow"), "shallower than": grow.format("fast")}.get(
        first, "the parts' rates differ too little to matter")
    why_second = {"steeper than": rate.format("fewer"), "shallower than": rate.format("more")}.get(
        second, "the rates hardly change with length")
    return (f"If every part kept its rate from the shortest length, the time would grow with slope "
            f"{at_fixed_rates:.2f}, {first} the count's {counted:.2f}: {why_first}. The measured slope, "
            f"{measured:.2f}, is {second} that: {why_second}.")


def listing(items: Sequence[str]) -> str:
    """Items as a sentence lists them: "a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def rate_changes(before: dict[str, float], after: dict[str, float], unit: str, margin: float = TIMING_MARGIN) -> str:
    """How each named rate moved from ``before`` to ``after``, a change inside the relative ``margin`` being none:
    "the rate of a falls from 24 to 6.7 and of b from 32 to 12 GFLOP/s; the rate of c stays within 25%"."""
    if too_noisy(margin):
        return f"whether the rates change is {TOO_NOISY} (paired readings {margin:.0%} apart)"
    groups: dict[int, list[str]] = {-1: [], 1: [], 0: []}
    for name, rate in before.items():
        groups[relation(after[name], rate, margin)].append(name)
    clauses = []
    for sign, verb in ((-1, "falls"), (1, "rises")):
        moves = [f"of {n} from {two_digits(before[n])} to {two_digits(after[n])}" for n in groups[sign]]
        if moves:
            moves[-1] += f" {unit}"  # the unit once, after the last number of the clause
            clauses.append(listing([f"the rate {moves[0].replace(' from ', f' {verb} from ', 1)}", *moves[1:]]))
    same = groups[0]
    if same:
        clauses.append(f"the rate of {same[0]} stays within {margin:.0%}" if len(same) == 1
                       else f"the rates of {listing(same)} stay within {margin:.0%}")
    return "; ".join(clauses)


def agreement(pairs: dict[str, tuple[float, float]], noun: str, reference: str, margin: float = TIMING_MARGIN) -> str:
    """Which named (measured, expected) pairs agree within the relative ``margin``, in one clause: "every measured
    ratio is within 25% of the count", or "a is 30% below the count; the other measured ratios are within 25% of
    it" (``noun`` names what the pairs measure, ``reference`` what they are compared with)."""
    if too_noisy(margin):
        return f"whether each {noun} agrees with {reference} is {TOO_NOISY} (paired readings {margin:.0%} apart)"
    apart = [(name, pair) for name, pair in pairs.items() if relation(*pair, margin)]
    outside = [f"{name} is {closeness(*pair, margin)} {reference if i == 0 else 'it'}"
               for i, (name, pair) in enumerate(apart)]
    inside = len(pairs) - len(outside)
    if not outside:
        return f"every {noun} is within {margin:.0%} of {reference}"
    if not inside:
        return listing(outside)
    others = f"the other {noun} is" if inside == 1 else f"the other {noun}s are"
    return f"{listing(outside)}; {others} within {margin:.0%} of it"


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.3g} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.3g} KiB"


def cache_fit(smaller: int, larger: int, caches: dict[int, int]) -> str:
    """Which of a processor's caches ({level: bytes}, ``measure.cache_sizes``) holds an array of ``smaller`` bytes and
    which one of ``larger``: "on this processor the smaller fits its level-2 cache (2 MiB), the larger only its
    level-3 cache (480 MiB, the last level, shared with whatever else runs on the machine)"."""
    if not caches:
        return "this processor does not report its cache sizes, so where such arrays lie is not known here"
    largest = f"the largest holds {_size(max(caches.values()))}"

    def cache(level: int | None) -> str:
        if level is None:
            return f"none of its caches ({largest})"
        last = ", the last level, shared with whatever else runs on the machine" if level == max(caches) else ""
        return f"its level-{level} cache ({_size(caches[level])}{last})"

    small, large = (min((lv for lv, size in caches.items() if size >= n), default=None) for n in (smaller, larger))
    exactly = ""  # an array of exactly a cache's size fits it only while nothing else is there
    if small is not None and caches[small] == smaller:
        exactly = (f"; the smaller is exactly the size of its level-{small} cache, so it fits there only "
                   "while nothing else does")
    if small == large:
        return (f"on this processor neither fits any of its caches ({largest})" if large is None
                else f"on this processor both fit {cache(large)}{exactly}")
    only = "" if large is None else "only "
    return f"on this processor the smaller fits {cache(small)}, the larger {only}{cache(large)}{exactly}"


def roofline(intensities: dict[str, float], ridge: float, margin: float | None = None) -> str:
    """Where each named FLOPs-per-byte figure stands against a ridge point, grouped: "MHA (0.5) is below the
    ridge: memory-bound; GQA (2) is within 25% of it: neither bound dominates; MQA (4) is above it: compute-bound".

    Without ``margin`` the figures are a spec sheet's, judged by the stated ``ROOFLINE_BAND`` ("within a factor
    of 2 of the ridge"); a ridge measured on this machine passes its ``paired_margin``, and above
    ``NOISY_MARGIN`` gets "too noisy on this build to say". Figures are printed as the prose prints them
    (``whole_or_two_digits``)."""
    named = {name: f"{name} ({whole_or_two_digits(x)})" for name, x in intensities.items()}
    if margin is not None and too_noisy(margin):
        return (f"where {listing(list(named.values()))} {'stands' if len(named) == 1 else 'stand'} against the "
                f"ridge is {TOO_NOISY} (paired readings {margin:.0%} apart)")
    near = f"within {margin:.0%} of the ridge" if margin is not None else \
        f"within a factor of {1 + ROOFLINE_BAND:g} of the ridge"
    groups: dict[int, list[str]] = {-1: [], 0: [], 1: []}
    for name, x in intensities.items():
        groups[relation(x, ridge, ROOFLINE_BAND if margin is None else margin)].append(named[name])
    words = {-1: ("below the ridge", "memory-bound"), 1: ("above the ridge", "compute-bound"),
             0: (near, "neither bound dominates")}
    clauses = []
    for sign in (-1, 0, 1):
        names = groups[sign]
        if names:
            where, bound = words[sign]
            if clauses:
                where = where.replace("the ridge", "it")
            clauses.append(f"{listing(names)} {'is' if len(names) == 1 else 'are'} {where}: {bound}")
    return "; ".join(clauses)
