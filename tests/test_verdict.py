"""The book's verdicts follow its measurements: rebuilt from measurements with 10% noise, the words
agree with the numbers printed beside them and never state the opposite of the noise-free truth."""

import re

import numpy as np
import pytest

from mha_lab.verdict import TIMING_MARGIN, closeness, relation, slope, speed

NOISE = 0.10
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
    assert re.search(r"within|same", words), words
    return 0


# true ratio of two times: clearly different, close to one, and on the margin's edge
TRUE_RATIOS = [0.3, 0.7, 0.8, 0.95, 1.0, 1.05, 1.2, 1.3, 2.0, 5.0]


@pytest.mark.parametrize("true_ratio", TRUE_RATIOS)
def test_speed_follows_the_printed_times_and_never_contradicts_the_truth(true_ratio):
    # the shape of the loop-vs-fused and MHA-vs-GQA sentences: two times, one verdict
    for _ in range(200):
        loop, fused = noisy(true_ratio * 1e-3), noisy(1e-3)
        words = speed("the loop", loop, "the fused layer", fused, TIMING_MARGIN)
        printed = loop / fused
        assert said(words) == relation(printed, 1.0, TIMING_MARGIN), (words, printed)
        if said(words):  # a stated factor is the printed one
            factor = float(re.search(r"([\d.]+)x", words).group(1))
            assert factor == pytest.approx(max(printed, 1 / printed), rel=0.05)
        assert said(words) * np.sign(true_ratio - 1) >= 0, (words, true_ratio)


@pytest.mark.parametrize("counted", [2.3, 3.0, 3.4])
def test_closeness_to_a_counted_ratio_follows_the_measurement(counted):
    # the step / forward sentence of the FLOPs chapter: a ratio of two times against the count
    for true in (0.5 * counted, 0.9 * counted, counted, 1.1 * counted, 1.6 * counted):
        for _ in range(200):
            measured = noisy(true) / noisy(1.0)
            words = closeness(measured, counted)
            assert said(words) == relation(measured, counted, TIMING_MARGIN)
            if said(words):
                percent = float(re.search(r"(\d+)%", words).group(1))
                assert percent == pytest.approx(100 * abs(measured / counted - 1), abs=0.51)
            assert said(words) * np.sign(true - counted) >= 0, (words, true, counted)


def test_a_verdict_changes_when_the_measurement_does():
    assert "slower" in speed("a", 2.0, "b", 1.0)
    assert "faster" in speed("a", 1.0, "b", 2.0)
    assert "same time within 25%" in speed("a", 1.1, "b", 1.0)
    assert closeness(3.0, 3.0, 0.1) == "within 10% of"
    assert closeness(2.1, 3.0, 0.1) == "30% below"
    assert closeness(3.6, 3.0, 0.1) == "20% above"


def test_slope_from_noisy_timings_follows_the_fit():
    from mha_lab.measure import fit_exponent

    lengths = np.array([128, 256, 512, 1024])
    for true_exponent in (1.5, 1.8, 2.0, 2.5):
        for _ in range(50):
            times = [noisy(L**true_exponent) for L in lengths]
            fitted = fit_exponent(lengths, times)
            words = slope(fitted, 1.8, margin=0.15)
            expected = 1 if fitted > 1.95 else -1 if fitted < 1.65 else 0
            assert said(words) == expected, (words, fitted)
            # 10% noise moves a fit over a factor of 8 in L by at most log(1.1/0.9)/log(8) < 0.1
            assert said(words) * np.sign(true_exponent - 1.8) >= 0, (words, true_exponent)


def test_bad_margins_and_values_are_refused():
    with pytest.raises(ValueError, match="margin"):
        relation(1.0, 1.0, -0.1)
    with pytest.raises(ValueError, match="positive reference"):
        relation(1.0, 0.0, 0.1)
    with pytest.raises(ValueError, match="margin"):
        slope(2.0, 2.0, -1)
