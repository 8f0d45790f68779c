"""How far a simulated point's figures move under changes smaller than what is known of them: the
same requests, each sent up to JITTER_S later than scheduled (the load generator's own send lag is
of that order: bench/serving/loadgen.py records 0.2-0.5 ms), every step priced up to PRICE_JITTER
higher or lower (two profiles of this machine an hour apart differ by 6-10%), simulated again and
again.

A request that arrives just before a step boundary joins that step; 0.1 ms later it waits for the
next one (a prefill chunk can last a second). With 20-24 requests a point, one request crossing a
boundary can move a TTFT percentile by several percent: adding 0.017 ms to each colocated step
moved one ShareGPT-like TTFT p90 by 9% (bench/README.md, plan7). A measured figure within 20% of
some jittered run's, but not of the unjittered one's, misses on that chance, not on the model.
"""
from __future__ import annotations

import random
from dataclasses import replace

from pdplan.profile import Profile

JITTER_S = 0.0005
PRICE_JITTER = 0.01


def spread(run, requests: list, profile: Profile, figures, runs: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Per figure label, (lowest, highest) over `runs` simulations, run(requests, profile) ->
    SimSummary, of `requests` each sent up to JITTER_S late, with the profile's step prices scaled
    by 1 +- up to PRICE_JITTER (the draws from Random(seed))."""
    rng = random.Random(seed)
    seen: dict[str, list[float]] = {label: [] for label, _, _ in figures}
    for _ in range(runs):
        late = [replace(r, arrival=r.arrival + rng.uniform(0.0, JITTER_S), token_times=[]) for r in requests]
        k = 1.0 + rng.uniform(-PRICE_JITTER, PRICE_JITTER)
        priced = replace(profile, step=profile.step.scaled(k))
        summary = run(late, priced)
        for label, metric, pct in figures:
            seen[label].append(getattr(getattr(summary, f"{metric}_ms"), pct))
    return {label: (min(v), max(v)) for label, v in seen.items()}


def verdict(row: dict, figures, tolerance: float, pricing: str = "") -> str:
    """'yes' when every figure is within tolerance of the measured value in the unjittered run,
    'maybe' when each is in some jittered run (its spread reaches the band), else 'no'. pricing:
    "" for the raw simulation's figures (`error`, `spread`), or another simulation's name
    ("node_priced": `node_priced_error`, `node_priced_spread`)."""
    error, spread_key = (f"{pricing}_error", f"{pricing}_spread") if pricing else ("error", "spread")
    if all(abs(row[f][error]) <= tolerance for f, _, _ in figures):
        return "yes"
    reach = all(row[f][spread_key][0] <= row[f]["measured"] * (1 + tolerance)
                and row[f][spread_key][1] >= row[f]["measured"] * (1 - tolerance) for f, _, _ in figures)
    return "maybe" if reach else "no"
