"""The live autoscaler: a loop in the router process that resizes each pool through its PoolScaler
(router/cluster/pool_scaler.py) from the router's own windowed figures (signals.py), as Dynamo's
load-based planner does.

Every interval, per pool (one step of one node at a time, within [min, max]):

    prefill  up   TTFT p90 > up_at x SLO, or prompt tokens booked per node > queued_tokens_up
             down TTFT p90 < down_at x SLO (or no first token in the window) and nothing booked
    decode   up   ITL p90 > up_at x SLO, or KV usage > kv_up, or Busy replies in the window
             down ITL p90 < down_at x SLO (or no token in the window) and KV usage < kv_down

Hysteresis: between down_at and up_at nothing changes; a pool shrinks only after every figure has
been low for down_after_s, and never within cooldown_s of its last change. Shrinking is a drain.
Every decision is logged and counted (pdserve_autoscaler_decisions_total{role,direction,reason});
pdserve_autoscaler_target{role} is the size each pool was last set to.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from pdplan.autoscale_config import AutoscaleConfig
from pdplan.signals import ITL, TTFT, MetricsWindow, Signals, pool_figures

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    role: str
    current: int
    target: int
    reason: str                     # what crossed its threshold ("ttft", "kv", "idle", ...)

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down"


class ScalePolicy:
    """Pure: signals and time in, at most one decision per pool out (remembers low-since and the
    last change per pool for hysteresis)."""

    def __init__(self, config: AutoscaleConfig):
        self.c = config
        self.low_since: dict[str, float | None] = {"prefill": None, "decode": None}
        self.changed_at: dict[str, float] = {"prefill": -1e18, "decode": -1e18}

    def decide(self, s: Signals, now: float) -> list[Decision]:
        out = []
        for role, current, (up, down) in (("prefill", s.prefill_nodes, self._prefill(s)),
                                          ("decode", s.decode_nodes, self._decode(s))):
            decision = self._step(role, current, up, down, now)
            if decision is not None:
                out.append(decision)
        return out

    def _prefill(self, s: Signals) -> tuple[str | None, str | None]:
        c = self.c
        ttft = self._p90(s.ttft_p90_ms, s.ttft_samples)
        if ttft is not None and ttft > c.autoscale_up_at * c.autoscale_slo_ttft_ms:
            return "ttft", None
        if s.queued_prefill_tokens > c.autoscale_queued_tokens_up:
            return "queued_tokens", None
        low = (s.ttft_samples == 0 or (ttft is not None and ttft < c.autoscale_down_at * c.autoscale_slo_ttft_ms)) \
            and s.queued_prefill_tokens == 0
        return None, ("idle" if s.ttft_samples == 0 else "ttft_low") if low else None

    def _decode(self, s: Signals) -> tuple[str | None, str | None]:
        c = self.c
        itl = self._p90(s.itl_p90_ms, s.itl_samples)
        if itl is not None and itl > c.autoscale_up_at * c.autoscale_slo_itl_ms:
            return "itl", None
        if s.decode_kv_usage > c.autoscale_kv_up:
            return "kv", None
        if s.busy_replies > 0:
            return "busy", None
        low = (s.itl_samples == 0 or (itl is not None and itl < c.autoscale_down_at * c.autoscale_slo_itl_ms)) \
            and s.decode_kv_usage < c.autoscale_kv_down
        return None, ("idle" if s.itl_samples == 0 else "itl_low") if low else None

    def _p90(self, p90: float | None, samples: int) -> float | None:
        """A p90 to act on: over at least min_samples observations. Fewer is not a trend (one slow
        request reads near the top of its bucket), and neither grows nor shrinks the pool."""
        return p90 if samples >= self.c.autoscale_min_samples else None

    def _step(self, role: str, current: int, up: str | None, down: str | None, now: float) -> Decision | None:
        lo, hi = self.c.bounds(role)
        if not down:
            self.low_since[role] = None
        elif self.low_since[role] is None:
            self.low_since[role] = now
        if now - self.changed_at[role] < self.c.autoscale_cooldown_s:
            return None
        if up and current < hi:
            return self._change(role, current, current + 1, up, now)
        if current < lo:
            return self._change(role, current, lo, "below_min", now)
        if down and current > lo and now - self.low_since[role] >= self.c.autoscale_down_after_s:
            return self._change(role, current, current - 1, down, now)
        return None

    def _change(self, role: str, current: int, target: int, reason: str, now: float) -> Decision:
        self.changed_at[role] = now
        self.low_since[role] = None
        return Decision(role, current, target, reason)


class Autoscaler:
    """The loop: sample the router's figures, decide, scale, log and count."""

    def __init__(self, config: AutoscaleConfig, operator, node_registry, metrics_registry, block_size: int,
                 clock: Callable[[], float] = time.monotonic):
        from prometheus_client import Counter, Gauge
        self.c, self.operator, self.nodes, self.block_size, self.clock = config, operator, node_registry, block_size, clock
        self.window = MetricsWindow(metrics_registry, config.autoscale_window_s, clock)
        self.policy = ScalePolicy(config)
        self.decisions: list[tuple[float, Decision, Signals]] = []
        self.counter = Counter("pdserve_autoscaler_decisions", "Pool size changes the autoscaler made.",
                               ["role", "direction", "reason"], registry=metrics_registry)
        self.target = Gauge("pdserve_autoscaler_target", "Nodes the autoscaler last set each pool to.",
                            ["role"], registry=metrics_registry)

    def signals(self) -> Signals:
        self.window.sample()
        queued, kv, prefill, decode = pool_figures(self.nodes, self.block_size)
        starting = self.operator.scaler.starting if self.operator.scaler is not None else (lambda role: 0)
        w = self.window
        return Signals(w.p90_ms(TTFT), w.p90_ms(ITL), w.busy(), queued, kv, prefill + starting("prefill"),
                       decode + starting("decode"), w.count(TTFT), w.count(ITL))

    async def tick(self) -> list[Decision]:
        s = self.signals()
        done = []
        for d in self.policy.decide(s, self.clock()):
            log.info("autoscaler: %s %s -> %s (%s; TTFT p90 %s ms, ITL p90 %s ms, queued %.0f tokens/node, "
                     "decode KV %.0f%%, Busy %d)", d.role, d.current, d.target, d.reason, _ms(s.ttft_p90_ms),
                     _ms(s.itl_p90_ms), s.queued_prefill_tokens, 100 * s.decode_kv_usage, s.busy_replies)
            try:
                await self.operator.scale(d.role, d.target, self.c.autoscale_drain_deadline_s)
            except Exception:           # this pool stays as it was and may be decided again at once;
                log.exception("autoscaler: scaling %s to %d failed", d.role, d.target)   # the other goes on
                self.policy.changed_at[d.role] = -1e18
                continue
            self.counter.labels(d.role, d.direction, d.reason).inc()
            self.target.labels(d.role).set(d.target)
            self.decisions.append((self.clock(), d, s))
            done.append(d)
        return done

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:           # one failed scale must not end autoscaling
                log.exception("autoscaler: a decision failed")
            await asyncio.sleep(self.c.autoscale_interval_s)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"
