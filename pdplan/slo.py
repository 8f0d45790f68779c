"""The latency targets a deployment is planned for, and whether one request met them.

A request meets the SLOs when it finished and met every target given:
    TTFT         arrival to its first token
    TPOT         (last token - first token) / (tokens - 1): its mean gap, as `vllm bench serve`
    ITL (p90)    the 90th percentile of its own gaps between tokens (optional)

The live autoscaler (autoscale_config.py: autoscale_slo_itl_ms) watches ITL p90 over all tokens of
its window. If every request's own p90 gap is within a bound, at most 10% of all gaps exceed it,
so the pooled p90 the autoscaler reads is within it too; a plan holds that for its attainment
share of requests (90%), so only the other 10% can push the pooled figure past the target.
Plan.autoscale_config hands the autoscaler the same targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdplan.sim_request import SimRequest

ITL_PERCENTILE = 90


@dataclass(frozen=True, slots=True)
class SLOTargets:
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    itl_ms: float | None = None     # p90 of a request's own gaps between tokens; None: not a target

    def __post_init__(self) -> None:
        if min(self.ttft_ms, self.tpot_ms, 1.0 if self.itl_ms is None else self.itl_ms) <= 0:
            raise ValueError(f"SLOs must be > 0: {self}")

    def met_by(self, r: SimRequest) -> bool:
        if not r.done or r.ttft * 1000 > self.ttft_ms or (r.tpot or 0.0) * 1000 > self.tpot_ms:
            return False
        return self.itl_ms is None or itl_p90(r) * 1000 <= self.itl_ms

    def describe(self) -> str:
        itl = f" / ITL p90 {self.itl_ms:g} ms" if self.itl_ms is not None else ""
        return f"TTFT {self.ttft_ms:g} ms / TPOT {self.tpot_ms:g} ms{itl}"


def itl_p90(r: SimRequest) -> float:
    """Seconds: the 90th percentile of the request's gaps between tokens (0 with one token)."""
    if len(r.token_times) < 2:
        return 0.0
    return float(np.percentile(np.diff(r.token_times), ITL_PERCENTILE))
