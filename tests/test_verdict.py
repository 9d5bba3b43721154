"""The book's verdicts follow its measurements: chosen values near and far from the margins give
the words written out here, and from measurements with 10% noise the words state the numbers
printed beside them and never the opposite of the noise-free truth."""

import re

import numpy as np
import pytest

from mha_lab.verdict import (
    NOISY_MARGIN,
    ROOFLINE_BAND,
    TIMING_MARGIN,
    TIMING_NOISE,
    TOO_NOISY,
    agreement,
    cache_fit,
    closeness,
    closeness_each,
    listing,
    paired_margin,
    rate_changes,
    relation,
    roofline,
    slope,
    slope_steps,
    speed,
    spread,
    too_noisy,
)

NOISE = TIMING_NOISE
rng = np.random.default_rng(0)


def noisy(x: float) -> float:
    """``x`` off by up to 10% either way: a timing on a busy machine."""
    return x * rng.uniform(1 - NOISE, 1 + NOISE)


def said(words: str) -> int:
    """The direction a verdict states: +1 (slower / above / steeper), -1, or 0 (no clear difference)."""
    if re.search(r"slower|above|steeper", words):
        return 1
    if re.search(r"faster|below|shallower", words):
        return -1
    assert re.search(r"within|no measurable difference|as steep as", words), words
    return 0


def test_the_timing_margin_covers_the_noise_of_a_ratio_of_two_timings():
    worst_ratio = (1 + TIMING_NOISE) / (1 - TIMING_NOISE)  # one timing high, the other low
    assert worst_ratio - 1 <= TIMING_MARGIN
    assert 1 / worst_ratio - 1 >= -TIMING_MARGIN


# (value, reference, margin) -> relation: the edges are inclusive, and the margin is relative,
# so a value 25% below is within it while one 26% below is not
RELATIONS = [
    (1.0, 1.0, 0.25, 0), (1.25, 1.0, 0.25, 0), (1.26, 1.0, 0.25, 1), (0.8, 1.0, 0.25, 0), (0.79, 1.0, 0.25, -1),
    (0.74, 1.0, 0.25, -1), (5.0, 1.0, 0.25, 1), (0.0, 1.0, 0.25, -1), (1.01, 1.0, 0.0, 1),
    (1.0, 1.0, 0.0, 0), (30.0, 20.0, 0.5, 0), (30.2, 20.0, 0.5, 1),
]


@pytest.mark.parametrize("value, reference, margin, expected", RELATIONS)
def test_relation_on_chosen_values(value, reference, margin, expected):
    assert relation(value, reference, margin) == expected


# (seconds, reference seconds, margin) -> words. Faster needs the reference 1/0.75 = 1.33x longer
SPEEDS = [
    (2.6e-3, 1e-3, TIMING_MARGIN, "a is 2.6 times slower than b"),
    (1.3, 1.0, TIMING_MARGIN, "a is 1.3 times slower than b"),
    (1.24, 1.0, TIMING_MARGIN, "a and b show no measurable difference on this machine (within 25%)"),
    (1.0, 1.0, TIMING_MARGIN, "a and b show no measurable difference on this machine (within 25%)"),
    (1.0, 1.25, TIMING_MARGIN, "a and b show no measurable difference on this machine (within 25%)"),
    (1.0, 1.34, TIMING_MARGIN, "a is 1.3 times faster than b"),
    (1.0, 20.0, TIMING_MARGIN, "a is 20 times faster than b"),
    (123.0, 1.0, TIMING_MARGIN, "a is 120 times slower than b"),  # two digits, no exponent
    (1.0, 1234.0, TIMING_MARGIN, "a is 1200 times faster than b"),
    (1.1, 1.0, 0.05, "a is 1.1 times slower than b"),
    (1.1, 1.0, 0.1, "a and b show no measurable difference on this machine (within 10%)"),
]


@pytest.mark.parametrize("seconds, ref_seconds, margin, words", SPEEDS)
def test_speed_on_chosen_times(seconds, ref_seconds, margin, words):
    assert speed("a", seconds, "b", ref_seconds, margin) == words


# (measured, expected, margin) -> words
CLOSENESS = [
    (3.0, 3.0, TIMING_MARGIN, "within 25% of"),
    (3.75, 3.0, TIMING_MARGIN, "within 25% of"),
    (3.9, 3.0, TIMING_MARGIN, "30% above"),
    (2.41, 3.0, TIMING_MARGIN, "within 25% of"),  # a factor of 1.25 either way
    (2.1, 3.0, TIMING_MARGIN, "30% below"),
    (9.0, 3.0, TIMING_MARGIN, "200% above"),
    (3.0, 3.0, 0.1, "within 10% of"),
    (2.1, 3.0, 0.1, "30% below"),
    (3.6, 3.0, 0.1, "20% above"),
]


@pytest.mark.parametrize("value, reference, margin, words", CLOSENESS)
def test_closeness_on_chosen_values(value, reference, margin, words):
    assert closeness(value, reference, margin) == words


# (fitted slope, model slope, absolute margin) -> words
SLOPES = [
    (2.0, 2.0, 0.1, "as steep as"),
    (2.09, 2.0, 0.1, "as steep as"),
    (2.11, 2.0, 0.1, "steeper than"),
    (1.91, 2.0, 0.1, "as steep as"),
    (1.89, 2.0, 0.1, "shallower than"),
    (3.0, 1.0, 0.1, "steeper than"),
    (0.5, 2.0, 0.1, "shallower than"),
    (1.94, 1.8, 0.15, "as steep as"),
    (1.96, 1.8, 0.15, "steeper than"),
    (1.64, 1.8, 0.15, "shallower than"),
]


@pytest.mark.parametrize("measured, model, margin, words", SLOPES)
def test_slope_on_chosen_values(measured, model, margin, words):
    """Cases chosen by hand on both sides of each edge. The bugs they catch: a margin taken relative to the
    model's slope (10% of 2.0 would call 2.11 "as steep as", 15% of 1.8 would call 1.96 and 1.64 so), the
    two words swapped, and a comparison against the margin alone instead of the model's slope plus it."""
    assert slope(measured, model, margin) == words


# (counted slope, slope at fixed rates, measured slope, margin) -> words
IF_FIXED = "If every part kept its rate from the shortest length, the time would grow with slope"
SLOW, SAME = "the parts that grow fastest are the slow ones", "the rates hardly change with length."
SLOPE_STEPS = [
    (1.75, 1.94, 2.18, 0.15, f"{IF_FIXED} 1.94, steeper than the count's 1.75: {SLOW}. The measured slope, 2.18, is "
     "steeper than that: the work does fewer FLOPs per second at the longest length than at the shortest."),
    (1.75, 1.94, 2.0, 0.15, f"{IF_FIXED} 1.94, steeper than the count's 1.75: {SLOW}. The measured slope, 2.00, is "
     f"as steep as that: {SAME}"),
    (1.75, 1.85, 1.6, 0.15, f"{IF_FIXED} 1.85, as steep as the count's 1.75: the parts' rates differ too little to "
     "matter. The measured slope, 1.60, is shallower than that: the work does more FLOPs per second at the longest "
     "length than at the shortest."),
    (1.75, 1.5, 1.5, 0.1, f"{IF_FIXED} 1.50, shallower than the count's 1.75: the parts that grow fastest are the "
     f"fast ones. The measured slope, 1.50, is as steep as that: {SAME}"),
]


@pytest.mark.parametrize("counted, fixed, measured, margin, words", SLOPE_STEPS)
def test_slope_steps_on_chosen_slopes(counted, fixed, measured, margin, words):
    assert slope_steps(counted, fixed, measured, margin) == words


# (rates before, rates after) -> words, at the timing margin of 25%
RATE_CHANGES = [
    ({"a": 24.0, "b": 1.3, "c": 32.0}, {"a": 6.7, "b": 1.05, "c": 11.5},
     "the rate of a falls from 24 to 6.7 and of c from 32 to 12 GFLOP/s; the rate of b stays within 25%"),
    ({"a": 1.0, "b": 2.0}, {"a": 1.26, "b": 1.65}, "the rate of a rises from 1 to 1.3 GFLOP/s; the rate of b stays "
     "within 25%"),
    ({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 0.5, "b": 2.4, "c": 2.5},
     "the rate of a falls from 1 to 0.5 GFLOP/s; the rates of b and c stay within 25%"),
    ({"a": 10.0, "b": 10.0, "c": 10.0}, {"a": 1.0, "b": 2.0, "c": 30.0},
     "the rate of a falls from 10 to 1 and of b from 10 to 2 GFLOP/s; the rate of c rises from 10 to 30 GFLOP/s"),
]


@pytest.mark.parametrize("before, after, words", RATE_CHANGES)
def test_rate_changes_on_chosen_rates(before, after, words):
    assert rate_changes(before, after, "GFLOP/s") == words


# (measured, expected) pairs -> words, at the timing margin of 25%: the margin's edge is inside
AGREEMENTS = [
    ({"a": (3.0, 3.0), "b": (3.75, 3.0)}, "every ratio is within 25% of the count"),
    ({"a": (2.1, 3.0), "b": (3.0, 3.0)}, "a is 30% below the count; the other ratio is within 25% of it"),
    ({"a": (2.1, 3.0), "b": (3.9, 3.0), "c": (3.0, 3.0), "d": (2.41, 3.0)},
     "a is 30% below the count and b is 30% above it; the other ratios are within 25% of it"),
    ({"a": (2.1, 3.0), "b": (6.0, 2.0)}, "a is 30% below the count and b is 200% above it"),
]


@pytest.mark.parametrize("pairs, words", AGREEMENTS)
def test_agreement_on_chosen_pairs(pairs, words):
    assert agreement(pairs, "ratio", "the count") == words



# several values against one reference -> words, at the timing margin of 25%
CLOSENESS_EACH = [
    ([3.0, 3.5], 3.0, "within 25% of"),
    ([1.4, 1.3], 3.0, "53% and 57% below"),
    ([3.9, 4.5], 3.0, "30% and 50% above"),
    ([2.1, 2.1], 3.0, "30% below"),
    ([3.0, 3.9], 3.0, "within 25% of and 30% above"),
    ([2.1, 3.9], 3.0, "30% below and 30% above"),
]


@pytest.mark.parametrize("values, reference, words", CLOSENESS_EACH)
def test_closeness_each_says_a_shared_direction_once(values, reference, words):
    assert closeness_each(values, reference) == words


@pytest.mark.parametrize("items, words", [(["a"], "a"), (["a", "b"], "a and b"), (["a", "b", "c"], "a, b and c")])
def test_listing(items, words):
    assert listing(items) == words

MiB = 2**20
CACHES = {1: 48 * 2**10, 2: 2 * MiB, 3: 480 * MiB}
L2_THEN_L3 = ("on this processor the smaller fits its level-2 cache (2 MiB), the larger only its level-3 cache "
              "(480 MiB, the last level, shared with whatever else runs on the machine)")
# (smaller bytes, larger bytes, caches) -> words; an array of exactly a cache's size fits only an empty one
CACHE_FITS = [
    (MiB, 64 * MiB, CACHES, L2_THEN_L3),
    (2 * MiB, 2 * MiB + 1, CACHES, L2_THEN_L3 + "; the smaller is exactly the size of its level-2 cache, so it fits "
     "there only while nothing else does"),
    (32 * 2**10, MiB, CACHES, "on this processor the smaller fits its level-1 cache (48 KiB), the larger only its "
     "level-2 cache (2 MiB)"),
    (MiB, 2 * MiB, CACHES, "on this processor both fit its level-2 cache (2 MiB)"),
    (MiB, 600 * MiB, CACHES, "on this processor the smaller fits its level-2 cache (2 MiB), the larger none of its "
     "caches (the largest holds 480 MiB)"),
    (500 * MiB, 600 * MiB, CACHES, "on this processor neither fits any of its caches (the largest holds 480 MiB)"),
    (MiB, 64 * MiB, {}, "this processor does not report its cache sizes, so where such arrays lie is not known here"),
]


@pytest.mark.parametrize("smaller, larger, caches, words", CACHE_FITS)
def test_cache_fit_on_chosen_sizes(smaller, larger, caches, words):
    assert cache_fit(smaller, larger, caches) == words


# true ratio of two times: clearly different, close to one, and on the margin's edge
TRUE_RATIOS = [0.3, 0.7, 0.8, 0.95, 1.0, 1.05, 1.2, 1.3, 2.0, 5.0]


@pytest.mark.parametrize("true_ratio", TRUE_RATIOS)
def test_speed_from_noisy_times_states_the_printed_factor_and_never_contradicts_the_truth(true_ratio):
    # the shape of the loop-vs-fused and MHA-vs-GQA sentences: two times, one verdict
    for _ in range(200):
        loop, fused = noisy(true_ratio * 1e-3), noisy(1e-3)
        words = speed("the loop", loop, "the fused layer", fused, TIMING_MARGIN)
        printed = loop / fused
        if said(words):  # a stated factor is the printed one
            factor = float(re.search(r"([\d.]+) times", words).group(1))
            assert factor == pytest.approx(max(printed, 1 / printed), rel=0.05)
        assert said(words) * np.sign(true_ratio - 1) >= 0, (words, true_ratio)


@pytest.mark.parametrize("counted", [2.3, 3.0, 3.4])
def test_closeness_from_noisy_times_states_the_printed_percentage_and_never_contradicts_the_truth(counted):
    # the step / forward sentence of the FLOPs chapter: a ratio of two times against the count
    for true in (0.5 * counted, 0.9 * counted, counted, 1.1 * counted, 1.6 * counted):
        for _ in range(200):
            measured = noisy(true) / noisy(1.0)
            words = closeness(measured, counted)
            if said(words):
                percent = float(re.search(r"(\d+)%", words).group(1))
                assert percent == pytest.approx(100 * abs(measured / counted - 1), abs=0.51)
            assert said(words) * np.sign(true - counted) >= 0, (words, true, counted)


def test_slope_from_noisy_timings_never_contradicts_the_true_exponent():
    from mha_lab.measure import fit_exponent

    lengths = np.array([128, 256, 512, 1024])
    for true_exponent in (1.5, 1.8, 2.0, 2.5):
        for _ in range(50):
            times = [noisy(L**true_exponent) for L in lengths]
            words = slope(fit_exponent(lengths, times), 1.8, margin=0.15)
            # 10% noise moves a fit over a factor of 8 in L by at most log(1.1/0.9)/log(8) < 0.1
            assert said(words) * np.sign(true_exponent - 1.8) >= 0, (words, true_exponent)


def test_bad_margins_and_values_are_refused():
    with pytest.raises(ValueError, match="margin"):
        relation(1.0, 1.0, -0.1)
    with pytest.raises(ValueError, match="positive reference"):
        relation(1.0, 0.0, 0.1)
    with pytest.raises(ValueError, match="margin"):
        slope(2.0, 2.0, -1)
    with pytest.raises(ValueError, match="margin"):
        slope_steps(1.75, 2.0, 2.0, -1)


def test_roofline_words_follow_each_intensity_against_the_ridge():
    words = roofline({"MHA": 0.5, "GQA": 2.4, "MQA": 4.0}, 2.8, margin=0.25)
    assert words == ("MHA (0.5) is below the ridge: memory-bound; GQA (2.4) is within 25% of it: neither bound "
                     "dominates; MQA (4) is above it: compute-bound")
    assert roofline({"a": 1.0, "b": 1.1}, 100) == "a (1) and b (1.1) are below the ridge: memory-bound"
    for _ in range(200):  # a measured ridge off by 10% never turns one side of the margin into the other
        true_ridge, x = 2.8, rng.uniform(0.1, 10)
        sign = {"below": -1, "within": 0, "above": 1}[roofline({"x": x}, noisy(true_ridge), 0.25).split()[3]]
        assert sign * np.sign(x - true_ridge) >= 0


def test_a_spec_sheet_roofline_states_its_own_threshold_and_prints_the_prose_digits():
    """The GQA chapter's figures against an H100's ridge of 989 / 3.35 = 295 FLOPs per byte: no timing margin
    (25%) but the stated band, a factor of 2; and the digits the prose prints (242, not 240; 29,199, not 29000)."""
    assert ROOFLINE_BAND == 1.0
    words = roofline({"MQA": 129.4, "absorbed MLA": 241.8, "rebuilt MLA": 29198.7}, 989 / 3.35)
    assert words == ("MQA (129) is below the ridge: memory-bound; absorbed MLA (242) is within a factor of 2 of it: "
                     "neither bound dominates; rebuilt MLA (29,199) is above it: compute-bound")
    # a timing margin would have called 0.44 of the ridge "neither"; the band calls 0.6 of it so, 0.4 not
    assert "neither" in roofline({"x": 0.6 * 295}, 295) and "memory-bound" in roofline({"x": 0.4 * 295}, 295)


def test_the_paired_margin_is_the_spread_of_the_per_pair_ratios():
    """The reshape chapter's readings at h = 64 (loop 94.6, 92.3, 54.8 ms; fused 57.8, 59.5, 33.8 ms): each series
    spreads by 73% and 76%, their product by 205%, under which a 1.6-fold difference is "no measurable" one. The
    pairs' ratios, 1.64, 1.55 and 1.62, spread by 5.5%: the loop is clearly 1.6 times slower."""
    loop, fused = [94.6, 92.3, 54.8], [57.8, 59.5, 33.8]
    margin = paired_margin(loop, fused)
    assert margin == pytest.approx((94.6 / 57.8) / (92.3 / 59.5) - 1) and round(margin, 3) == 0.055
    assert (1 + spread(loop)) * (1 + spread(fused)) - 1 > 2.0  # what multiplying the spreads gave
    assert speed("the loop", min(loop), "the fused layer", min(fused), margin) == \
        "the loop is 1.6 times slower than the fused layer"
    assert paired_margin([1.0, 1.01], [1.0, 1.0]) == 0.05  # never below MIN_MARGIN
    with pytest.raises(ValueError, match="two positive readings"):
        spread([1.0])
    with pytest.raises(ValueError, match="one reference per reading"):
        paired_margin([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive references"):
        paired_margin([1.0, 2.0], [1.0, 0.0])


def test_above_half_every_verdict_says_too_noisy_and_nothing_else():
    assert NOISY_MARGIN == 0.5 and too_noisy(0.51) and not too_noisy(0.5)
    margin = paired_margin([10.0, 21.0, 14.0], [10.0, 10.0, 10.0])  # ratios 1, 2.1, 1.4: 110%
    for words in (speed("MHA", 30e-3, "GQA", 10e-3, margin), closeness(3.0, 1.0, margin),
                  closeness_each([3.0, 0.1], 1.0, margin), rate_changes({"a": 1.0}, {"a": 5.0}, "GFLOP/s", margin),
                  agreement({"a": (9.0, 3.0)}, "ratio", "the count", margin), roofline({"x": 10.0}, 1.0, margin)):
        assert TOO_NOISY in words, words
        assert not re.search(r"slower|faster|above|below|within|falls|rises|bound", words), words
    assert "110%" in speed("MHA", 30e-3, "GQA", 10e-3, margin)


@pytest.mark.parametrize("true_ratio", TRUE_RATIOS)
def test_a_verdict_with_the_paired_margin_never_contradicts_the_truth(true_ratio):
    """Each round reads both times under the machine's load of that moment (from none to 3 times slower), and
    within a pair each reading jitters by up to 2%. Whatever the load, a ratio of a pair is the true ratio within
    (1.02 / 0.98) = 4.1%, below the 5% floor: so the verdict cannot be the opposite of the truth, and a true
    ratio far outside the jitter is named, however much the load moved the series."""
    for _ in range(200):
        loads = rng.uniform(1.0, 3.0, size=3)
        a = [true_ratio * 1e-3 * load * rng.uniform(0.98, 1.02) for load in loads]
        b = [1e-3 * load * rng.uniform(0.98, 1.02) for load in loads]
        margin = paired_margin(a, b)
        words = speed("a", min(a), "b", min(b), margin)
        assert said(words) * np.sign(true_ratio - 1) >= 0, (words, true_ratio, margin)
        if abs(np.log(true_ratio)) > np.log(1.05 * 1.05 / 0.96):  # far outside jitter and floor: named
            assert said(words) == np.sign(true_ratio - 1), (words, true_ratio, margin)
