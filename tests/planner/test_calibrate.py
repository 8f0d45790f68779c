"""calibrate.py's request_s over the colocated requests of the calibration runs: each completed
request's measured TTFT less its simulated one, the median of those (on the committed quiet3
ShareGPT-like run's colocated part)."""
from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest

from bench.simulate.calibrate import calibrate, colocated_gaps
from pdplan.profile import Overheads, Profile
from tests.planner.test_validate import PROFILE, _colocated


def test_a_constant_in_front_shifts_every_colocated_request_by_itself():
    """One gap per completed request (2 points of 24), measured - simulated; with request_s 10 ms
    every gap is 10 ms less (a colocated run shifts whole: the median of the gaps is the fit)."""
    measured = _colocated()
    bare = replace(Profile.load(PROFILE), overheads=Overheads())
    gaps = colocated_gaps([measured], bare)
    assert len(gaps) == sum(q["success"] for p in measured["systems"]["colocated"]["points"] for q in p["requests"]) == 48
    first = measured["systems"]["colocated"]["points"][0]["requests"][0]["ttft_ms"] / 1e3
    assert first - gaps[0] > 0.01                       # a simulated TTFT: a prefill step at least
    shifted = colocated_gaps([measured], replace(bare, overheads=Overheads(request_s=0.010)))
    assert shifted == [pytest.approx(g - 0.010, abs=1e-9) for g in gaps]


def test_request_s_is_the_median_gap_of_the_colocated_requests(tmp_path):
    """calibrate's request_s is the median of the gaps simulated with its other overheads and
    request_s 0; with it, the gaps' median is 0."""
    path = tmp_path / "colocated.json"
    path.write_text(json.dumps(_colocated()))
    fitted = calibrate([str(path)], Profile.load(PROFILE))
    request_s = fitted.overheads.request_s
    gaps = colocated_gaps([_colocated()], replace(fitted, overheads=replace(fitted.overheads, request_s=0.0)))
    assert request_s == pytest.approx(max(0.0, statistics.median(gaps)))
    assert request_s > 0
    assert statistics.median(colocated_gaps([_colocated()], fitted)) == pytest.approx(0.0, abs=1e-9)


def test_with_node_speed_each_gap_is_taken_against_the_node_priced_simulation():
    """Every colocated point given MIN_STEPS recorded decode steps at twice their price: with
    node_speed "cpu" each request's simulated TTFT is its simulation with every step twice as dear
    (so each gap is exactly the raw gap at a 2x profile, and smaller than the raw one); without
    node_speed, or on a point without steps, the gaps are the raw ones."""
    from bench.simulate.node_steps import MIN_STEPS, NodeStep
    measured, profile = _colocated(), Profile.load(PROFILE)
    shape = ((1, 100), (1, 300))
    line = NodeStep(1.0, 2 * profile.step.of(list(shape)), shape).line()
    stepped = json.loads(json.dumps(measured))
    for point in stepped["systems"]["colocated"]["points"]:
        point["steps"] = {"colocated-0": [line] * MIN_STEPS}
    raw = colocated_gaps([measured], profile)
    assert colocated_gaps([stepped], profile) == raw == colocated_gaps([measured], profile, "cpu")
    priced = colocated_gaps([stepped], profile, "cpu")
    k = NodeStep.parse(line).cpu_s / profile.step.of(list(shape))      # 2, to the line's microsecond
    assert k == pytest.approx(2.0, rel=1e-3)
    assert priced == pytest.approx(colocated_gaps([measured], profile.at_speed(k)), abs=1e-9)
    assert all(p < r for p, r in zip(priced, raw))
