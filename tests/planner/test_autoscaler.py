"""The autoscaler's policy (hysteresis, cooldown, bounds) and its windowed quantiles."""
from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
from prometheus_client import CollectorRegistry

from pdplan.autoscale_config import AutoscaleConfig
from pdplan.autoscaler import Autoscaler, ScalePolicy
from pdplan.signals import TTFT, Signals, quantile

CONFIG = AutoscaleConfig(autoscale=True, autoscale_slo_ttft_ms=100.0, autoscale_slo_itl_ms=20.0,
                         autoscale_down_after_s=10.0, autoscale_cooldown_s=5.0, autoscale_max_prefill=3,
                         autoscale_max_decode=3)


def signals(ttft=None, itl=None, busy=0, queued=0.0, kv=0.0, p=1, d=1) -> Signals:
    return Signals(ttft, itl, busy, queued, kv, p, d, 0 if ttft is None else 100, 0 if itl is None else 100)


def moves(policy: ScalePolicy, s: Signals, now: float) -> list[tuple[str, int, str]]:
    return [(d.role, d.target, d.reason) for d in policy.decide(s, now)]


def test_each_pool_grows_on_its_own_signal():
    """TTFT over 80% of its SLO grows prefill only; ITL, KV usage or Busy replies grow decode only."""
    assert moves(ScalePolicy(CONFIG), signals(ttft=90, itl=5), 0) == [("prefill", 2, "ttft")]
    assert moves(ScalePolicy(CONFIG), signals(ttft=10, itl=17), 0) == [("decode", 2, "itl")]
    assert moves(ScalePolicy(CONFIG), signals(ttft=10, itl=5, kv=0.9), 0) == [("decode", 2, "kv")]
    assert moves(ScalePolicy(CONFIG), signals(ttft=10, itl=5, busy=2), 0) == [("decode", 2, "busy")]
    assert moves(ScalePolicy(CONFIG), signals(queued=5000, itl=5), 0) == [("prefill", 2, "queued_tokens")]


def test_nothing_moves_between_the_thresholds_or_past_the_bounds():
    """Latencies between down_at and up_at: no change; at max no growth, at min no shrink."""
    policy = ScalePolicy(CONFIG)
    assert moves(policy, signals(ttft=50, itl=10, p=2, d=2), 0) == []
    assert moves(policy, signals(ttft=50, itl=10, p=2, d=2), 100) == []
    assert moves(ScalePolicy(CONFIG), signals(ttft=500, itl=50, p=3, d=3), 0) == []
    assert moves(ScalePolicy(CONFIG), signals(p=1, d=1), 1000) == []


def test_shrinking_waits_for_down_after_s_of_low_figures_and_the_cooldown():
    """Low from t=0: nothing until t=10; a high reading in between restarts the wait; then one
    node per cooldown."""
    policy = ScalePolicy(CONFIG)
    assert moves(policy, signals(p=2, d=3), 0) == []
    assert moves(policy, signals(p=2, d=3), 9) == []
    assert moves(policy, signals(p=2, d=3), 10) == [("prefill", 1, "idle"), ("decode", 2, "idle")]
    assert moves(policy, signals(p=1, d=2), 12) == []            # low again since this reading
    assert moves(policy, signals(itl=4, p=1, d=2), 21) == []
    assert moves(policy, signals(itl=4, p=1, d=2), 22) == [("decode", 1, "itl_low")]
    fresh = ScalePolicy(CONFIG)
    assert moves(fresh, signals(d=2), 0) == []
    assert moves(fresh, signals(itl=10, d=2), 5) == []                        # not low: the wait restarts
    assert moves(fresh, signals(d=2), 6) == [] and moves(fresh, signals(d=2), 15) == []
    assert moves(fresh, signals(d=2), 16) == [("decode", 1, "idle")]


def test_growth_respects_the_cooldown():
    """Two high readings 2 s apart: one step up, then none until the cooldown has passed."""
    policy = ScalePolicy(CONFIG)
    assert moves(policy, signals(itl=50), 0) == [("decode", 2, "itl")]
    assert moves(policy, signals(itl=50, d=2), 2) == []
    assert moves(policy, signals(itl=50, d=2), 5) == [("decode", 3, "itl")]


def test_quantile_interpolates_within_a_bucket_like_prometheus():
    """90% of 10 observations, all in (0.1, 0.2]: 0.1 + 0.9 * 0.1 s; empty: None; +Inf: its lower bound."""
    buckets = [(0.1, 0.0), (0.2, 10.0), (math.inf, 10.0)]
    assert quantile(0.9, buckets) == pytest.approx(190.0)
    assert quantile(0.9, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 4.0)]) == pytest.approx(100.0)


def test_bad_bounds_are_refused():
    """min > max, or down_at >= up_at, is a ValueError at construction."""
    with pytest.raises(ValueError):
        AutoscaleConfig(autoscale_min_decode=3, autoscale_max_decode=2)
    with pytest.raises(ValueError):
        AutoscaleConfig(autoscale_down_at=0.9, autoscale_up_at=0.8)


def test_a_failed_scale_leaves_the_other_pool_scaled_and_is_tried_again_at_once():
    """Both pools are due to grow; the prefill scale raises: the decode pool still grows, the
    failure is neither counted nor exported, and the next tick decides prefill again without
    waiting out a cooldown for a change that never happened."""
    class Operator:
        scaler = None

        def __init__(self):
            self.fail, self.calls = {"prefill"}, []

        async def scale(self, role, count, deadline_s):
            self.calls.append((role, count))
            if role in self.fail:
                raise RuntimeError("no room for another node")

    operator, registry = Operator(), CollectorRegistry()
    scaler = Autoscaler(CONFIG, operator, None, registry, 16, clock=lambda: 100.0)
    scaler.signals = lambda: signals(ttft=90, itl=17)
    assert [(d.role, d.target) for d in asyncio.run(scaler.tick())] == [("decode", 2)]
    assert registry.get_sample_value("pdserve_autoscaler_target", {"role": "prefill"}) is None
    assert registry.get_sample_value("pdserve_autoscaler_target", {"role": "decode"}) == 2
    operator.fail = set()
    assert [(d.role, d.target) for d in asyncio.run(scaler.tick())] == [("prefill", 2)]
    assert operator.calls == [("prefill", 2), ("decode", 2), ("prefill", 2)]


def test_a_p90_over_fewer_requests_than_min_samples_is_not_acted_on():
    """Three first tokens of 120 ms in the window: their 'p90' reads 235 ms (near the top of the
    (0.1, 0.25] bucket, as histogram_quantile interpolates), past 80% of a 250 ms SLO. Under
    min_samples (8) it is not a trend: prefill neither grows nor (at 2 nodes) shrinks, as it would
    with no request at all. Eight of them are a p90, and prefill grows."""
    from prometheus_client import Histogram

    registry, now = CollectorRegistry(), [0.0]
    ttft = Histogram("pdserve_time_to_first_token_seconds", "TTFT", buckets=(0.1, 0.25, 1.0), registry=registry)
    config = AutoscaleConfig(autoscale=True, autoscale_slo_ttft_ms=250.0, autoscale_window_s=10.0,
                             autoscale_down_after_s=0.0, autoscale_cooldown_s=0.0)
    assert config.autoscale_min_samples == 8
    scaler = Autoscaler(config, None, None, registry, 16, clock=lambda: now[0])
    scaler.window.sample()

    def observe(k: int, t: float):
        for _ in range(k):
            ttft.observe(0.12)
        now[0] = t
        scaler.window.sample()
        w = scaler.window
        return Signals(w.p90_ms(TTFT), None, 0, 0.0, 0.0, 2, 1, w.count(TTFT), 0)
    few = observe(3, 1.0)
    assert few.ttft_samples == 3 and few.ttft_p90_ms == pytest.approx(235.0)
    assert moves(ScalePolicy(config), few, 10) == []
    assert moves(ScalePolicy(config), signals(p=2), 10) == [("prefill", 1, "idle")]     # no request: idle
    enough = observe(5, 2.0)
    assert enough.ttft_samples == 8 and enough.ttft_p90_ms == pytest.approx(235.0)
    assert moves(ScalePolicy(config), dataclasses.replace(enough, prefill_nodes=1), 10) == [("prefill", 2, "ttft")]
    with pytest.raises(ValueError, match="min_samples"):
        AutoscaleConfig(autoscale_min_samples=0)
