"""ITL (p90 of a request's gaps) as an SLO beside TTFT and TPOT: per request, in the planner's search,
on `pdserve plan`'s command line, and in the autoscaler flags a plan hands on."""
from __future__ import annotations

import argparse
import json

import pytest

from engine.flags import add_dataclass_args, build_dataclass, to_argv
from pdplan.autoscale_config import AutoscaleConfig
from pdplan.planner import Planner, PlanRequest
from pdplan.sim_request import SimRequest
from pdplan.simulation import Topology, simulate
from pdplan.slo import SLOTargets, itl_p90
from tests.planner.test_planner import PROFILE, uniform


def _timed(gaps_ms: list[float], ttft_ms: float = 50.0) -> SimRequest:
    times = [ttft_ms / 1000]
    for g in gaps_ms:
        times.append(times[-1] + g / 1000)
    return SimRequest(0, 0.0, 16, len(times), (), token_times=times)


def test_itl_p90_is_the_requests_own_tail_gap():
    """8 gaps of 10 ms and 2 of 200 ms: TPOT 48 ms (mean) meets 50, ITL p90 200 ms misses 100."""
    r = _timed([10.0] * 8 + [200.0] * 2)
    assert r.tpot * 1000 == pytest.approx(48.0)
    assert itl_p90(r) * 1000 == pytest.approx(200.0)
    assert SLOTargets(100, 50).met_by(r)
    assert not SLOTargets(100, 50, itl_ms=100).met_by(r)
    assert SLOTargets(100, 50, itl_ms=200).met_by(r)


def test_every_target_must_hold_and_unfinished_requests_never_meet():
    """A miss on any one SLO fails the request; so does not finishing."""
    r = _timed([10.0] * 10, ttft_ms=120.0)
    assert not SLOTargets(100, 50, itl_ms=100).met_by(r)
    assert not SLOTargets(200, 5, itl_ms=100).met_by(r)
    unfinished = SimRequest(0, 0.0, 16, 20, (), token_times=r.token_times)
    assert not SLOTargets(1000, 1000).met_by(unfinished)
    with pytest.raises(ValueError):
        SLOTargets(100, 50, itl_ms=0)


def test_an_itl_target_lowers_attainment_where_prefills_stall_decodes():
    """Colocated, 600-token prompts at 40 req/s on 9 replicas: TPOT 40 ms is met by all, but each
    decode's gaps include its replica's prefill steps, so an ITL p90 of 60 ms is met by fewer."""
    reqs = uniform("", 200, 40.0, 0, 16, 4096)
    loose = simulate(PROFILE, reqs, Topology(colocated=9), SLOTargets(300, 40)).slo_attainment
    tight = simulate(PROFILE, reqs, Topology(colocated=9), SLOTargets(300, 40, itl_ms=60)).slo_attainment
    assert loose >= 0.9 > tight


def test_the_planner_grows_the_fleet_for_an_itl_target_and_the_plan_meets_it():
    """The same load with ITL p90 <= 30 ms needs more nodes of both kinds than without, and >= 90%
    of requests at the recommended split have their own p90 gap within 30 ms."""
    base = dict(min_requests=200, window_s=5.0, max_requests=200)
    without = Planner(PROFILE, uniform).plan(PlanRequest("uniform", 40.0, 300.0, 40.0, **base))
    tight = Planner(PROFILE, uniform).plan(PlanRequest("uniform", 40.0, 300.0, 40.0, 30.0, **base))
    assert tight.colocated.topology.nodes > without.colocated.topology.nodes
    assert tight.disaggregated.topology.decode > without.disaggregated.topology.decode
    reqs = uniform("", 200, 40.0, 0, 16, 4096)
    simulate(PROFILE, reqs, Topology.disaggregated(tight.disaggregated.topology.prefill,
                                                   tight.disaggregated.topology.decode))
    assert sum(itl_p90(r) * 1000 <= 30.0 for r in reqs) >= 0.9 * len(reqs)


def test_the_plans_autoscale_flags_build_the_autoscalers_config():
    """Plan.autoscale_config: same TTFT, ITL target = the ITL SLO (else TPOT), the planned pools as
    ceilings; its flags, parsed as `pdserve up` parses them, give back the same config."""
    base = dict(min_requests=200, window_s=5.0, max_requests=200)
    for itl, expected in ((30.0, 30.0), (None, 40.0)):
        plan = Planner(PROFILE, uniform).plan(PlanRequest("uniform", 40.0, 300.0, 40.0, itl, **base))
        config = plan.autoscale_config()
        t = plan.disaggregated.topology
        assert (config.autoscale, config.autoscale_slo_ttft_ms, config.autoscale_slo_itl_ms) == (True, 300.0, expected)
        assert (config.autoscale_max_prefill, config.autoscale_max_decode) == (t.prefill, t.decode)
        ap = argparse.ArgumentParser()
        add_dataclass_args(ap, AutoscaleConfig)
        assert build_dataclass(AutoscaleConfig, vars(ap.parse_args(to_argv(config)))) == config


def test_to_argv_writes_only_what_differs_from_the_defaults():
    """Booleans as --flag / --no-flag, other scalars as --flag value; defaults left out."""
    config = AutoscaleConfig(autoscale=True, autoscale_max_decode=5, autoscale_slo_itl_ms=70.0)
    assert to_argv(config) == ["--autoscale", "--autoscale-max-decode", "5", "--autoscale-slo-itl-ms", "70.0"]
    assert to_argv(AutoscaleConfig()) == []


def test_pdserve_plan_takes_an_itl_slo(tmp_path, capsys):
    """`pdserve plan --itl-ms` plans for it (in the JSON request) and hands it to the autoscaler."""
    from router.launcher import main
    path = tmp_path / "p.json"
    PROFILE.save(str(path))
    main(["plan", "--profile", str(path), "--workload", "sharegpt", "--rate", "2", "--num-requests", "60",
          "--slo-ttft-ms", "2000", "--slo-tpot-ms", "200", "--itl-ms", "150", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["request"]["slo_itl_ms"] == 150.0
    assert plan["autoscale"]["autoscale_slo_itl_ms"] == 150.0
    assert plan["disaggregated"]["summary"]["slo_attainment"] >= 0.9
