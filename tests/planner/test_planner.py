"""The planner's search: the fewest nodes that meet the SLOs, colocated and P:D."""
from __future__ import annotations

from pdplan.planner import Planner, PlanRequest, fewest
from pdplan.profile import Profile, StepCost, Transfer
from pdplan.sim_request import SimRequest
from pdplan.simulation import SLOTargets, Topology, simulate

STEP = StepCost(fixed=0.010, per_token=2e-4, per_seq=1e-4, per_decode_ctx=1e-6, per_prefill_pair=1e-9)
PROFILE = Profile({}, {}, 16, 2048, 32, 1024, STEP, Transfer(5e-4, 1e-4, 1 << 19))


def test_fewest_finds_the_threshold_and_none_past_the_limit():
    """fewest() returns the least good k (by doubling and bisection), None when none is."""
    assert [fewest(lambda k, t=t: k >= t, 64) for t in (1, 2, 3, 17, 64)] == [1, 2, 3, 17, 64]
    assert fewest(lambda k: k >= 65, 64) is None


def uniform(workload, n, rate, seed, block_size, max_model_len):
    """Same-shaped requests (600-token prompts, 40 tokens out), evenly spaced."""
    return [SimRequest(i, i / rate, 600, 40, tuple(range(i * 1000, i * 1000 + 37))) for i in range(n)]


def test_plan_is_the_fewest_nodes_and_one_less_misses():
    """The recommended fleets meet the target; one node fewer (in either pool) does not."""
    req = PlanRequest("uniform", 40.0, 300.0, 40.0, min_requests=200, window_s=5.0, max_requests=200)
    plan = Planner(PROFILE, uniform).plan(req)
    reqs = uniform("", 200, 40.0, 0, 16, 4096)
    slo = SLOTargets(300.0, 40.0)
    n = plan.colocated.topology.colocated
    assert plan.colocated.summary.slo_attainment >= 0.9
    assert n == 1 or simulate(PROFILE, reqs, Topology(colocated=n - 1), slo).slo_attainment < 0.9
    p, d = plan.disaggregated.topology.prefill, plan.disaggregated.topology.decode
    assert plan.disaggregated.summary.slo_attainment >= 0.9
    for fewer in (Topology.disaggregated(p - 1, d), Topology.disaggregated(p, d - 1)):
        assert fewer.prefill == 0 or fewer.decode == 0 or simulate(PROFILE, reqs, fewer, slo).slo_attainment < 0.9
    assert plan.best.goodput_per_node == max(plan.colocated.goodput_per_node, plan.disaggregated.goodput_per_node)


def test_a_large_rate_is_planned_on_a_slice_and_scaled():
    """Past max_requests the fleet is k copies of the simulated slice."""
    req = PlanRequest("uniform", 200.0, 300.0, 40.0, min_requests=100, window_s=5.0, max_requests=250)
    plan = Planner(PROFILE, uniform).plan(req)
    assert plan.scale == 4
    assert plan.colocated.topology.colocated % 4 == 0
    assert plan.colocated.goodput_per_node == 200.0 / plan.colocated.topology.colocated


def test_pdserve_profile_then_plan_from_the_command_line(tmp_path, capsys):
    """`pdserve profile --quick` writes a profile of the built-in model; `pdserve plan --json` on it
    prints a plan whose recommendation is one of its two options."""
    import json
    from router.launcher import main
    out = tmp_path / "p.json"
    main(["profile", "--quick", "--dtype", "float32", "--num-blocks", "512", "--max-num-batched-tokens", "256",
          "--out", str(out)])
    assert Profile.load(str(out)).samples
    capsys.readouterr()
    main(["plan", "--profile", str(out), "--workload", "alpaca", "--rate", "2", "--num-requests", "60",
          "--max-model-len", "512", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"] in (plan["colocated"]["topology"], plan["disaggregated"]["topology"])
    assert plan["colocated"]["summary"]["slo_attainment"] >= 0.9


def test_no_recommendation_when_no_fleet_meets_the_slos():
    """A TTFT target below one prompt's prefill step cannot be met by any fleet: neither option
    has a summary, and the plan recommends nothing (it named the largest fleet tried before)."""
    req = PlanRequest("uniform", 40.0, 1.0, 40.0, min_requests=50, window_s=5.0, max_requests=50, max_nodes=8)
    plan = Planner(PROFILE, uniform).plan(req)
    assert plan.colocated.summary is None and plan.disaggregated.summary is None
    assert plan.best is None and plan.to_dict()["recommended"] is None
    assert "recommended: none" in plan.describe()


def test_the_split_is_shrunk_past_a_dip_in_attainment():
    """Attainment not monotone in P (1P+9D meets, 2P and 3P miss, 9P meets): the split found at
    9P+9D shrinks to 1P, then sheds decode nodes while the target still holds (down to 7D)."""
    from types import SimpleNamespace
    good = {(1, 9), (5, 9), (9, 9), (1, 8), (1, 7)}
    run = lambda t: SimpleNamespace(slo_attainment=1.0 if (t.prefill, t.decode) in good else 0.5)   # noqa: E731
    found = Planner._shrink(run, 0.9, Topology.disaggregated(9, 9), run(Topology.disaggregated(9, 9)))
    assert found.topology == Topology.disaggregated(1, 7)
