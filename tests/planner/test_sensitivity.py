"""bench/simulate/sensitivity.py: how far a simulated point moves under sub-ms send jitter and a 1%
price change, and the verdict that spread allows."""
from __future__ import annotations

from bench.simulate.sensitivity import PRICE_JITTER, spread, verdict
from bench.simulate.validate import FIGURES
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens


def test_a_lone_requests_ttft_moves_with_the_price_alone():
    """One request alone on a colocated engine: its TTFT is its one prefill step, so over the runs it
    stays within the price's +-1% (the send jitter moves the arrival and the step alike), and the
    runs do differ; the same seed gives the same spread."""
    reqs = [request(0, tokens(100), 4)]
    run = lambda rs, p: simulate(p, rs, Topology(colocated=1))       # noqa: E731
    got = spread(run, reqs, profile(), FIGURES, runs=8, seed=3)
    lo, hi = got["TTFT p50"]
    price_ms = STEP.of([(100, 0)]) * 1e3
    assert price_ms * (1 - PRICE_JITTER) - 1e-9 <= lo < hi <= price_ms * (1 + PRICE_JITTER) + 1e-9
    assert spread(run, reqs, profile(), FIGURES, runs=8, seed=3) == got


def _row(errors: list[float], spreads: list[tuple[float, float]]) -> dict:
    return {label: {"measured": 100.0, "error": e, "spread": s} for (label, _, _), e, s in zip(FIGURES, errors, spreads)}


def test_the_verdict_is_maybe_only_when_every_figures_spread_reaches_the_band():
    """Within 20% unjittered: yes. Out, but each figure's jittered range reaches 80..120: maybe.
    One figure's range short of the band: no."""
    assert verdict(_row([0.1, -0.1, 0.0], [(110, 110), (90, 90), (100, 100)]), FIGURES, 0.2) == "yes"
    assert verdict(_row([0.3, -0.1, 0.0], [(115, 130), (90, 90), (100, 100)]), FIGURES, 0.2) == "maybe"
    assert verdict(_row([0.3, -0.3, 0.0], [(115, 130), (60, 75), (100, 100)]), FIGURES, 0.2) == "no"


def test_the_verdict_reads_the_pricing_it_is_asked_about():
    """pricing="node_priced": the node-priced error and spread decide, the raw ones are not read."""
    row = {label: {"measured": 100.0, "node_priced_error": e, "node_priced_spread": s}
           for (label, _, _), e, s in zip(FIGURES, [0.3, -0.1, 0.0], [(115, 130), (90, 90), (100, 100)])}
    assert verdict(row, FIGURES, 0.2, "node_priced") == "maybe"
    row[FIGURES[1][0]]["node_priced_spread"] = (60, 75)
    assert verdict(row, FIGURES, 0.2, "node_priced") == "no"
