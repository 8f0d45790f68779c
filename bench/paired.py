"""Paired differences of two variants measured in interleaved rounds, and their spread.

A shared machine moves a transfer's time by more than the per-block overhead being measured:
the difference of two medians (each variant's own) mixes the drift between rounds into the
figure. Taken per round, pdserve's time minus its neighbouring ceiling's in the same round, the
drift common to both cancels; the median of those differences is the figure, and their spread
(min, quartiles, max) says how far one round can be trusted.
"""
from __future__ import annotations

import math
import statistics
from typing import NamedTuple, Sequence


class Spread(NamedTuple):
    """Order statistics of a sample (quartiles by statistics.quantiles, 'inclusive'), and the
    median's ~95% confidence interval: the order statistics whose ranks bound it whatever the
    distribution (binomial, normal approximation; for 8 values or fewer, the whole range)."""
    median: float
    lo: float
    q1: float
    q3: float
    hi: float
    ci_lo: float
    ci_hi: float
    n: int

    def scaled(self, factor: float) -> "Spread":
        return Spread(*(v * factor for v in self[:7]), self.n)

    def as_dict(self) -> dict:
        return self._asdict()


def spread(xs: Sequence[float]) -> Spread:
    """median, min, quartiles, max of xs (at least one value)."""
    xs, n = sorted(xs), len(xs)
    if n < 2:
        return Spread(*[xs[0]] * 7, n)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    half = 1.96 * math.sqrt(n) / 2
    lo_rank, hi_rank = max(1, round(n / 2 - half)), min(n, round(n / 2 + 1 + half))    # 1-based
    return Spread(statistics.median(xs), xs[0], q1, q3, xs[-1], xs[lo_rank - 1], xs[hi_rank - 1], n)


def paired_differences(a: Sequence[float], b: Sequence[float]) -> Spread:
    """a[r] - b[r] over the rounds r both ran."""
    return spread([x - y for x, y in zip(a, b)])


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> Spread:
    """b[r] / a[r] over the rounds: a's speed as a share of b's (times, so b over a)."""
    return spread([y / x for x, y in zip(a, b)])
