"""The transfer bench's paired statistics (bench/paired.py) on hand-made rounds."""
import random

from bench.paired import paired_differences, paired_ratios, spread


def test_paired_difference_cancels_drift_between_rounds():
    """A fixed gap on top of a drift common to both variants of a round comes back exactly."""
    drift = [1.0, 5.0, 2.0, 9.0, 3.0, 7.0]
    ceiling = [d + 0.5 for d in drift]
    pdserve = [d + 0.5 + 0.02 for d in drift]
    s = paired_differences(pdserve, ceiling)
    assert s.n == 6 and abs(s.median - 0.02) < 1e-12 and abs(s.hi - s.lo) < 1e-12
    assert spread(pdserve).hi - spread(pdserve).lo == 8.0      # unpaired, the drift is all the spread


def test_spread_order_statistics():
    """median, min, quartiles ('inclusive'), max; one value is all of them."""
    s = spread([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s.median, s.lo, s.q1, s.q3, s.hi, s.n) == (3.0, 1.0, 2.0, 4.0, 5.0, 5)
    assert tuple(spread([7.0])[:7]) == (7.0,) * 7


def test_median_interval_is_order_statistics_that_cover_it():
    """16 values: the 4th and 13th smallest; 8 values or fewer: the whole range."""
    s = spread(range(16))
    assert (s.ci_lo, s.ci_hi) == (3, 12)
    s = spread(range(8))
    assert (s.ci_lo, s.ci_hi) == (0, 7)


def test_median_interval_covers_the_true_median_about_95_percent():
    """Over 2,000 samples of 16 normal values the interval holds the true median 93-99% of the time."""
    rng = random.Random(1)
    hits = sum(s.ci_lo <= 0 <= s.ci_hi for s in (spread([rng.gauss(0, 1) for _ in range(16)]) for _ in range(2000)))
    assert 0.93 * 2000 <= hits <= 0.99 * 2000


def test_ratio_is_the_ceiling_time_over_pdserve_time():
    """pdserve at half the ceiling's speed in every round: 0.5."""
    s = paired_ratios([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (s.median, s.lo, s.hi) == (0.5, 0.5, 0.5)
