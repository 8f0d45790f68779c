"""What a simulated run reports, defined as bench/serving/metrics.py defines it for real runs:
TTFT, TPOT = (E2EL - TTFT) / (tokens - 1), ITL (gaps between tokens), SLO attainment (the share of
all requests meeting every SLO given: TTFT, TPOT and, if set, ITL p90; slo.py), goodput (vLLM's:
requests meeting them per second of the run), and the busy share of each pool's step loops."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from pdplan.sim_request import SimRequest
from pdplan.slo import SLOTargets


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: list[float]) -> "Percentiles":
        ms = np.asarray(values_s or [0.0]) * 1000
        return cls(*(float(np.percentile(ms, p)) for p in (50, 90, 99)))


@dataclass(frozen=True, slots=True)
class SimSummary:
    requests: int
    completed: int
    duration_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    slo_attainment: float
    goodput: float                  # requests meeting every SLO per second
    utilization: dict[str, float]   # pool -> busy share of its nodes' time
    preemptions: int
    admission_waits: int
    node_times: dict[str, tuple[float, float]] = field(default_factory=dict)   # node -> (core s: prices + bus, s its steps took)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(requests: list[SimRequest], slo: SLOTargets, busy_s: dict[str, tuple[float, int]],
              preemptions: int, waits: int, warmup_s: float = 0.0) -> SimSummary:
    """Latencies, attainment and goodput over the requests that arrived from warmup_s on (all of
    them if none did); the busy shares over the whole run."""
    run_s = _span(requests)
    requests = [r for r in requests if r.arrival >= warmup_s] or requests
    done = [r for r in requests if r.done]
    duration = _span(requests)
    ok = sum(slo.met_by(r) for r in requests)
    return SimSummary(
        len(requests), len(done), duration, Percentiles.of([r.ttft for r in done]),
        Percentiles.of([r.tpot for r in done if r.tpot is not None]),
        Percentiles.of([b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]),
        ok / len(requests), ok / duration,
        {pool: busy / (nodes * run_s) for pool, (busy, nodes) in busy_s.items()}, preemptions, waits)


def _span(requests: list[SimRequest]) -> float:
    """Seconds from the first arrival to the last token of those that finished."""
    start = min(r.arrival for r in requests)
    return max(max((r.token_times[-1] for r in requests if r.done), default=start) - start, 1e-9)
