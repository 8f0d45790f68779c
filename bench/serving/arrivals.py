"""Request arrival times: gamma-distributed gaps with mean 1/rate (as `vllm bench serve` draws them).

burstiness = the gamma shape k: 1 is a Poisson process, < 1 burstier, > 1 more regular. The gaps
have mean 1/rate and coefficient of variation 1/sqrt(k). rate = inf sends everything at t = 0.

A few dozen draws can miss the rate by 20% or more, which would mislabel a point of a rate sweep;
with `exact_rate` (the default) the drawn gaps are scaled so the schedule's own rate,
(n - 1) / (last - first), is exactly `rate`. The gaps keep their shape (burstiness).
"""
from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                  exact_rate: bool = True) -> np.ndarray:
    """Send offsets in seconds from the start, shape [n], the first at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    if exact_rate and n > 1:
        gaps *= (n - 1) / (rate * gaps.sum())
    return np.cumsum(gaps)


def achieved_rate(send_times: list[float]) -> float:
    """Requests per second actually sent: (n - 1) / (last send - first send)."""
    if len(send_times) < 2:
        return float("nan")
    span = max(send_times) - min(send_times)
    return (len(send_times) - 1) / span if span > 0 else float("inf")
