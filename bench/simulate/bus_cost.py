"""What a prefill step on one core costs a decode step on the other, from traces (trace.py): the
two cores of the validation's machine share its L3 and its memory bus, and a 58M float32 model
streams 234 MB of weights a step. Per traced disaggregated point,

    factor = median(CPU / price of the decode steps the prefill node's steps overlapped > 90%)
           / median(CPU / price of the decode steps they overlapped < 10%)

over the decode node's pure decode steps (every sequence one token; its own thread's CPU time,
so a core shared with another decode node does not count), priced by a profile: a ratio of two
ratios, so what the profile gets wrong about the machine's speed that day cancels. Read by a
scratch script in plan8 (bench/README.md): 1.05-1.15 in the three RAG 1P+1D traces of trace3,
plan5 and trace7. `calibrate --beside-from` writes the median over the points given into the
profile (Overheads.beside_prefill), which pdplan/sim_bus.py applies to the nodes pinned on one
machine.
"""
from __future__ import annotations

import statistics
from typing import NamedTuple

from bench.simulate.trace import load

ALONE, BESIDE = 0.1, 0.9    # a step's share overlapped by the prefill node's steps: below, above
MIN_STEPS = 5               # of each, for a point to give a factor


class PointFactor(NamedTuple):
    out_dir: str
    factor: float
    alone: int          # decode steps read alone ...
    beside: int         # ... and beside a prefill step


def point_factor(out_dir: str, profile) -> PointFactor | None:
    """The factor of one traced point; None with fewer than MIN_STEPS decode steps alone or beside."""
    events = load(out_dir)
    prefill = sorted((e["t0"], e["t"]) for e in events if e["e"] == "step" and e["p"].startswith("prefill"))
    alone, beside = [], []
    for e in events:
        if e["e"] != "step" or not e["p"].startswith("decode") or "cpu" not in e or not e.get("shapes") \
                or any(n != 1 for n, _ in e["shapes"]) or e["t"] <= e["t0"]:
            continue
        share = sum(max(0.0, min(e["t"], b) - max(e["t0"], a)) for a, b in prefill) / (e["t"] - e["t0"])
        ratio = e["cpu"] / profile.step.of([tuple(x) for x in e["shapes"]])
        if share < ALONE:
            alone.append(ratio)
        elif share > BESIDE:
            beside.append(ratio)
    if len(alone) < MIN_STEPS or len(beside) < MIN_STEPS:
        return None
    return PointFactor(out_dir, statistics.median(beside) / statistics.median(alone), len(alone), len(beside))


def beside_prefill(out_dirs: list[str], profile) -> tuple[float, list[PointFactor]]:
    """(the median factor over the points that give one, at least 1; those points)."""
    points = [f for f in (point_factor(d, profile) for d in out_dirs) if f is not None]
    if not points:
        raise ValueError(f"no traced point of {out_dirs} has {MIN_STEPS} decode steps both alone and beside a prefill step")
    return max(1.0, statistics.median(f.factor for f in points)), points
