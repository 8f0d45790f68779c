"""What the autoscaler reads, all from the router itself: windowed TTFT and inter-token latency
percentiles from its own Prometheus histograms (the bucket counts now less those `window_s` ago,
interpolated within a bucket as Prometheus' histogram_quantile does), the decode nodes' Busy
replies counted in the window (a prefill node's Busy is its grammar compiler's load), and per
pool the nodes' figures (prompt tokens booked on prefill nodes, KV usage of decode nodes) from the
node registry."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
BUSY = "pdserve_router_busy_replies_total"
BUSY_DECODE = {"role": "decode"}    # the series of BUSY the decode pool's signal reads


@dataclass(frozen=True, slots=True)
class Signals:
    ttft_p90_ms: float | None       # None: no first token in the window
    itl_p90_ms: float | None
    busy_replies: float             # decode nodes', in the window
    queued_prefill_tokens: float    # per active prefill node
    decode_kv_usage: float          # mean over active decode nodes, 0..1
    prefill_nodes: int              # active
    decode_nodes: int
    ttft_samples: int = 0           # first tokens in the window (the TTFT p90's observations)
    itl_samples: int = 0            # inter-token gaps in the window


@dataclass(frozen=True, slots=True)
class _Snapshot:
    t: float
    buckets: dict[str, list[tuple[float, float]]]   # histogram -> [(upper bound, cumulative count)]
    busy: float


class MetricsWindow:
    """Snapshots of the router's registry, kept for `window_s`; figures over the window."""

    def __init__(self, registry, window_s: float, clock: Callable[[], float]):
        self.registry, self.window_s, self.clock = registry, window_s, clock
        self.snapshots: deque[_Snapshot] = deque()

    def sample(self) -> None:
        now = self.clock()
        self.snapshots.append(_Snapshot(now, {TTFT: self._buckets(TTFT), ITL: self._buckets(ITL)},
                                        self.registry.get_sample_value(BUSY, BUSY_DECODE) or 0.0))
        while len(self.snapshots) > 2 and self.snapshots[1].t <= now - self.window_s:
            self.snapshots.popleft()

    def p90_ms(self, name: str) -> float | None:
        return quantile(0.9, self._delta(name))

    def count(self, name: str) -> int:
        """Observations of histogram `name` in the window."""
        delta = self._delta(name)
        return int(delta[-1][1]) if delta else 0

    def _delta(self, name: str) -> list[tuple[float, float]]:
        first, last = self.snapshots[0], self.snapshots[-1]
        return [(le, b - a) for (le, b), (_, a) in zip(last.buckets[name], first.buckets[name])]

    def busy(self) -> float:
        return self.snapshots[-1].busy - self.snapshots[0].busy

    def _buckets(self, name: str) -> list[tuple[float, float]]:
        for metric in self.registry.collect():
            if metric.name == name and metric.type == "histogram":
                return [(float(s.labels["le"]), s.value) for s in metric.samples if s.name.endswith("_bucket")]
        return []


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile in ms of cumulative (upper bound s, count) buckets; None when empty.
    Linear within the bucket; the +Inf bucket answers its lower bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower * 1000
            return (lower + (le - lower) * (rank - below) / max(count - below, 1e-12)) * 1000
        lower, below = le, count
    return lower * 1000


def pool_figures(registry, block_size: int) -> tuple[float, float, int, int]:
    """(prompt tokens booked per active prefill node, mean KV usage of active decode nodes,
    active prefill nodes, active decode nodes) from the router's node registry."""
    from router.cluster.registry import NodeRole, NodeState
    prefill = [n for n in registry.nodes(NodeRole.PREFILL) if n.state is NodeState.ACTIVE]
    decode = [n for n in registry.nodes(NodeRole.DECODE) if n.state is NodeState.ACTIVE]
    queued = sum(n.inflight_blocks for n in prefill) * block_size / max(1, len(prefill))
    kv = sum(n.load.kv_usage for n in decode) / max(1, len(decode))
    return queued, kv, len(prefill), len(decode)
