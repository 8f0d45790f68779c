"""Serving metrics, defined exactly as `vllm bench serve` computes them, plus the vLLM paper's
normalized latency and DistServe's SLO attainment.

Per request, from the streamed chunks that carry text (times from the moment it was sent):

    send ──────── chunk 1 ──── chunk 2 ── ... ── chunk k
      |── TTFT ──|── ITL ────|── ITL ──|         |
      |───────────────── E2EL ───────────────────|

    TPOT = (E2EL - TTFT) / (output_tokens - 1)       only when output_tokens > 1
    output_tokens = the server's usage.completion_tokens (else the number of text chunks)

Over a run of wall time T (first send to last completion), counting completed requests only:
request throughput = completed / T; output throughput = sum(output_tokens) / T.
Goodput (vLLM's definition) = completed requests meeting every SLO (value <= SLO) / T.
SLO attainment (DistServe's) = requests meeting both the TTFT and TPOT SLOs / requests sent
(failed ones count as misses); DistServe goodput is a sweep: the highest rate at which the
attainment is >= 90% (`distserve_goodput`).
Normalized latency (vLLM paper) = mean over completed requests of E2EL / output_tokens.
Latencies are reported in milliseconds; percentiles use numpy's linear interpolation.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline as the client saw it. Times in seconds."""
    prompt_len: int
    expected_output_len: int
    kind: str = "chat"
    send_time: float = 0.0          # from the benchmark start
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)   # gaps between consecutive text chunks
    latency: float = 0.0            # E2EL: send to the last text chunk
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    response_id: str = ""           # the response's "id" (pdserve: the router's request id)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in milliseconds; None: not checked."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        """All set SLOs hold (vLLM: a single-token request's TPOT counts as 0)."""
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot or 0.0), (self.e2el_ms, r.latency))
        return r.success and all(slo is None or value * 1000 <= slo for slo, value in checks)


@dataclass(frozen=True, slots=True)
class Dist:
    """Mean and percentiles of one latency metric, ms."""
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> "Dist":
        ms = np.asarray(seconds or [0.0]) * 1000      # vLLM reports 0 for an empty list
        return cls(float(ms.mean()), *(float(np.percentile(ms, p)) for p in PERCENTILES))


@dataclass(frozen=True, slots=True)
class ServingMetrics:
    num_sent: int
    completed: int
    failed: int
    duration_s: float
    offered_rate: float             # requests/s asked for (inf: all at once)
    achieved_rate: float            # requests/s actually sent
    request_throughput: float       # completed / duration
    output_throughput: float        # output tokens / s
    total_token_throughput: float   # (prompt + output tokens of completed requests) / s
    total_output_tokens: int
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2el: Dist
    normalized_latency_s: float     # mean E2EL / output tokens, s per token
    goodput: float                  # vLLM: completed requests meeting every SLO / s
    slo_attainment: float           # DistServe: share of all requests meeting TTFT and TPOT SLOs
    slo: SLO

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], duration_s: float, offered_rate: float, achieved_rate: float,
              slo: SLO) -> ServingMetrics:
    done = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in done)
    both = SLO(slo.ttft_ms, slo.tpot_ms)
    return ServingMetrics(
        num_sent=len(records), completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        offered_rate=offered_rate, achieved_rate=achieved_rate,
        request_throughput=len(done) / duration_s, output_throughput=out_tokens / duration_s,
        total_token_throughput=(out_tokens + sum(r.prompt_len for r in done)) / duration_s,
        total_output_tokens=out_tokens,
        ttft=Dist.of([r.ttft for r in done]),
        tpot=Dist.of([r.tpot for r in done if r.tpot is not None]),
        itl=Dist.of([gap for r in done for gap in r.itl]),
        e2el=Dist.of([r.latency for r in done]),
        normalized_latency_s=float(np.mean([r.latency / r.output_tokens for r in done if r.output_tokens]))
        if done else float("nan"),
        goodput=sum(slo.met_by(r) for r in done) / duration_s,
        slo_attainment=sum(both.met_by(r) for r in records) / len(records) if records else float("nan"),
        slo=slo,
    )


def distserve_goodput(points: list[tuple[float, float]], target: float = 0.9) -> float:
    """DistServe goodput from a sweep of (rate, SLO attainment): the highest swept rate whose
    attainment, and that of every lower rate, is >= target; 0 when even the lowest misses."""
    best = 0.0
    for rate, attainment in sorted(points):
        if attainment < target:
            break
        best = rate
    return best
