"""How far a measured figure could have landed by chance alone: a quiet set's point is 20-24
requests, so its TTFT p90 is set by its two or three slowest (np.percentile's linear interpolation
between the 21st and 22nd of 24), and one request that happens to share a step with a long prefill
moves it by seconds. The point's own requests, resampled with replacement (the bootstrap), give
the figure's interval; a simulated figure inside it is one this measurement cannot tell from its
own repeat, while one outside it misses whatever the sample. A point's requests are not independent
(they queue behind one another), so the interval is if anything narrower than a rerun's spread.

    interval(values(point["requests"], "ttft"), "p90")  ->  (low, high), ms
"""
from __future__ import annotations

import numpy as np

from bench.serving.metrics import RequestRecord

RUNS = 2000         # resamples
LEVEL = 0.9         # the interval holds the middle 90% of the resampled figures


def values(requests: list[dict], metric: str) -> np.ndarray:
    """The point's successful requests' `metric` ("ttft" or "tpot"), ms, as bench/serving/metrics.py
    takes them for the point's figures (a request of one output token has no TPOT). Read from the
    fields every result file's requests carry (older ones hold ITL percentiles, not the gaps)."""
    if metric not in ("ttft", "tpot"):
        raise ValueError(f"no per-request values for {metric!r}: ttft or tpot")
    records = [RequestRecord(r["prompt_len"], r["output_len"], ttft=r["ttft_ms"] / 1000, latency=r["e2el_ms"] / 1000,
                             output_tokens=r["output_tokens"], success=r["success"]) for r in requests]
    seconds = [getattr(r, metric) for r in records if r.success]
    return np.array([s * 1000 for s in seconds if s is not None], dtype=float)


def interval(ms: np.ndarray, pct: str, runs: int = RUNS, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """(low, high): the middle `level` of the figure `pct` ("p50", "p90") over `runs` resamples of
    `ms`; (nan, nan) for no values."""
    if len(ms) == 0:
        return float("nan"), float("nan")
    draws = np.random.default_rng(seed).integers(0, len(ms), (runs, len(ms)))
    figures = np.percentile(ms[draws], float(pct.lstrip("p")), axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(figures, (tail, 100 - tail))
    return float(low), float(high)


def inside(simulated: float, span: tuple[float, float]) -> bool:
    """The simulated figure lies within the measured one's interval (never within an empty sample's)."""
    return span[0] <= simulated <= span[1]
