"""Two costs of the real request path that the traces found (bench/README.md, "What the trace
found"), each on a small scripted case: a decode node answers its reservation only between steps,
and the processes pinned nowhere (router, load generator) take a node's core when no core is idle."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pdplan.events import EventLoop
from pdplan.profile import Overheads
from pdplan.sim_core import FloatingWork, SimCore
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens


def test_a_reservation_waits_for_the_decode_nodes_running_step():
    """A decodes alone on D; B (100 tokens: via the prefill node) arrives mid-step. B's prefill starts
    only when that step ends, so TTFT = the rest of D's step + B's prefill; with D idle, the prefill."""
    a = request(0, tokens(40), 200)                         # local: D prefills it and decodes
    b = request(1, tokens(100, 500), 2, at=0.5)
    simulate(profile(), [a, b], Topology.disaggregated(1, 1))
    step_end = min(t for t in a.token_times if t >= 0.5)
    assert step_end > 0.5
    assert b.ttft == pytest.approx(step_end - 0.5 + STEP.of([(100, 0)]))
    alone = request(1, tokens(100, 500), 2, at=0.5)
    simulate(profile(), [alone], Topology.disaggregated(1, 1))
    assert alone.ttft == pytest.approx(STEP.of([(100, 0)]))


def _ends(loop: EventLoop, steps: list[tuple[SimCore, float]]) -> list[float]:
    ends = [0.0] * len(steps)
    for i, (core, work) in enumerate(steps):
        core.run(work, lambda i=i: ends.__setitem__(i, loop.now))
    return ends


def test_floating_work_runs_on_an_idle_core_and_slows_no_step():
    loop = EventLoop()
    cores = [SimCore(loop), SimCore(loop)]
    ends = _ends(loop, [(cores[1], 0.1)])
    FloatingWork(cores).add(0.02)
    loop.run()
    assert ends == [pytest.approx(0.1)]


def test_floating_work_with_no_idle_core_shares_the_core_it_last_ran_on():
    """Both cores in a 100 ms step; 20 ms of floating work joins core 0 (where it ran before): both
    advance at half speed until it is done at 40 ms, so core 0's step ends at 120 ms; core 1's at 100."""
    loop = EventLoop()
    cores = [SimCore(loop), SimCore(loop)]
    ends = _ends(loop, [(cores[0], 0.1), (cores[1], 0.1)])
    floating = FloatingWork(cores)
    floating.add(0.02)
    loop.run()
    assert ends == [pytest.approx(0.12), pytest.approx(0.1)]
    assert floating.cpu_s == pytest.approx(0.02)


def test_steady_floating_work_takes_its_share_while_the_run_lasts():
    """A core in a 100 ms step, 0.25 CPU seconds a second of steady floating work (a router's polls):
    it comes 5 ms every 20 ms and shares the core, which costs the step 5 ms at each of the ticks
    at 20-120 ms: it ends at 130 ms. The work stops once running() is false, or once nothing else
    is scheduled (the loop then ends)."""
    loop = EventLoop()
    core = SimCore(loop)
    ends = _ends(loop, [(core, 0.1)])
    loop.at(0.5, lambda: None)                                   # something later: ticks go on while running()
    floating = FloatingWork([core])
    floating.steady(loop, 0.25, lambda: loop.now < 0.19)
    loop.run()
    assert ends == [pytest.approx(0.13)]
    assert floating.cpu_s == pytest.approx(0.25 * 0.18)      # ticks at 20, 40, ... 180 ms: nine of 5 ms
    assert loop.pending == 0
    idle = EventLoop()
    FloatingWork([SimCore(idle)]).steady(idle, 0.25, lambda: True)
    idle.run()                                                   # only ticks left: they stop
    assert idle.now == pytest.approx(0.02)


def test_floating_work_without_a_machine_costs_nothing():
    floating = FloatingWork([])
    floating.add(1.0)
    assert floating.cpu_s == 0.0 and not floating.running


def _pinned_1p1d() -> Topology:
    return Topology.disaggregated(1, 1).pinned({"prefill-0": {0}, "decode-0": {1}}, machine_cores=2)


def test_a_prompt_prefilled_while_another_streams_waits_for_its_core():
    """1P+1D on a 2-core machine, the router's and client's work per streamed token floating: while
    A streams (decode core busy) B's prefill shares the prefill core with that work, so B's TTFT
    grows; B alone, or on separate hosts (no machine), it does not."""
    p = replace(profile(), overheads=Overheads(router_token_s=0.004, client_token_s=0.002))

    def ttft(topo: Topology, with_stream: bool) -> float:
        b = request(1, tokens(300, 500), 2, at=0.5)
        simulate(p, ([request(0, tokens(40), 400)] if with_stream else []) + [b], topo)
        return b.ttft
    hosts = ttft(Topology.disaggregated(1, 1), True)
    assert ttft(_pinned_1p1d(), False) == pytest.approx(ttft(Topology.disaggregated(1, 1), False))
    assert ttft(_pinned_1p1d(), True) > hosts + 0.005


def test_the_load_generator_on_the_idle_core_costs_a_colocated_engine_nothing():
    """Colocated on core 0 of two: the client's floating work runs on core 1, so every token time is
    as without it."""
    p = replace(profile(), overheads=Overheads(client_token_s=0.004))
    times = []
    for prof in (p, profile()):
        r = request(0, tokens(100), 30)
        simulate(prof, [r], Topology(colocated=1).pinned({"colocated-0": {0}}, machine_cores=2))
        times.append(r.token_times)
    assert times[0] == pytest.approx(times[1])


def test_a_colocated_front_end_shares_its_engines_core_when_pinned():
    """Colocated on core 0 of two, A decoding; B (1,000 tokens) reaches the front end's CPU work
    (2 us a token of its 4) exactly as A's step k starts. Both then take half the core: B's 2 ms
    are done 4 ms in, A's step ends 2 ms late and B joins the next step. On a host of its own the
    front end costs only time: A's step is as alone, and B is admitted 4 ms after it arrived."""
    front = replace(profile(), overheads=Overheads(prompt_token_s=4e-6, front_cpu_token_s=2e-6))
    pinned = Topology(colocated=1).pinned({"colocated-0": {0}}, machine_cores=2)
    alone = request(0, tokens(40), 200)
    simulate(front, [alone], pinned)
    k = 50
    start, step = alone.token_times[k], alone.token_times[k + 1] - alone.token_times[k]
    for topology, late, admitted in ((pinned, 0.002, start + 0.004), (Topology(colocated=1), 0.0, start + 0.002)):
        a, b = request(0, tokens(40), 200), request(1, tokens(1000, 500), 2, at=start - 0.002)
        simulate(front, [a, b], topology)
        assert a.token_times[:k + 1] == pytest.approx(alone.token_times[:k + 1])
        assert a.token_times[k + 1] == pytest.approx(start + step + late)
        # B waits for the step it arrived in, then its own prefill beside A's decode
        assert admitted < a.token_times[k + 1] < b.arrival + b.ttft


def test_a_node_pinned_past_the_machine_is_refused():
    with pytest.raises(ValueError):
        Topology.disaggregated(1, 1).pinned({"prefill-0": {0}, "decode-0": {2}}, machine_cores=2)


def test_the_simulated_decode_choice_has_the_routers_load_guard(monkeypatch):
    """A 3,200-token document (200 blocks) cached on decode-0, which the router's view (its last
    heartbeat) shows running 40 sequences, decode-1 none: by cost alone (1 block missing against
    201) decode-0 takes the next request on the document; with the guard (as the real router's,
    routing_cost.py: 40 - 0 > 32 and 40 > 1.5 x 0) decode-1 does."""
    import pdplan.decode_pool as decode_pool
    from pdplan.decode_pool import DecodePool
    from pdplan.events import EventLoop
    doc, balance = tokens(3200), decode_pool.BALANCE

    def chosen(guard: bool) -> str:
        monkeypatch.setattr(decode_pool, "BALANCE", balance if guard else None)
        pool = DecodePool(2, profile(num_blocks=4096), EventLoop(), lambda: None)
        req = request(1, doc + tokens(8, 10_000), 40)
        for h in req.block_hashes[:200]:
            pool.nodes[0].engine.pool.cached[h] = None
        pool.nodes[0].view.beat_seqs = 40
        return pool.reserve(req)[0].engine.name
    assert (chosen(False), chosen(True)) == ("decode-0", "decode-1")


def test_a_burst_on_one_idle_document_stays_on_the_node_holding_it():
    """The router books a request on its decode node with the blocks the node takes, as its reply
    says (router/cluster/admission.py _taken), and prices a node with the blocks the request would
    add there (routing_cost.py): 10 requests on one 200-block document cached on one node, which no
    request uses there, arrive within 10 ms. The first goes to the holder and takes the document's
    200 idle blocks too (201 in use); the rest stay there (1 + k queued + 201 + k in use + 1 added,
    against 201 uncached + 201 added on the other node): 10 of 10."""
    doc = tokens(3200)
    reqs = [request(0, doc + tokens(8, 9_000), 2)]                  # puts the document on one decode node
    reqs += [request(i, doc + tokens(8, 10_000 + 8 * i), 40, at=10 + 0.001 * i) for i in range(1, 11)]
    simulate(profile(num_blocks=4096, max_seqs=64), reqs, Topology.disaggregated(1, 2))
    holder = reqs[0].decode_node
    assert [r.decode_node == holder for r in reqs[1:]] == [True] * 10


def test_calibrate_takes_the_unpinned_cpu_per_token_from_measured_points():
    """router: the disaggregated points' router CPU / output tokens; client: every point's; medians."""
    from bench.simulate.calibrate import floating_cpu

    def point(tokens: int, client: float, router: float | None = None) -> dict:
        cpu = {"client": {"run_s": client, "wait_s": 0.0}}
        if router is not None:
            cpu["router"] = {"run_s": router, "wait_s": 0.0}
        return {"metrics": {"total_output_tokens": tokens}, "float_cpu": cpu}
    measured = {"systems": {"colocated": {"points": [point(1000, 0.3)]},
                            "1p1d": {"points": [point(1000, 0.4, 0.6), point(2000, 1.0, 1.0), {"metrics": {
                                "total_output_tokens": 10}}]}}}
    trace = {"system": "1p1d", "points": [point(1000, 0.5, 0.55)]}
    assert floating_cpu([measured, trace]) == (pytest.approx(0.55e-3), pytest.approx(0.45e-3), 0.0, 0.0)
    assert floating_cpu([{"systems": {"colocated": {"points": [{"metrics": {"total_output_tokens": 5}}]}}}]) \
        == (0.0, 0.0, 0.0, 0.0)


def test_calibrate_splits_the_unpinned_cpu_into_per_token_and_per_second():
    """Points of 26-128 s (sim28: the per-token median alone was 26-39% off them): the router's CPU
    is 20 ms a second + 0.45 ms a token, the client's 8 ms + 0.3 ms; least squares gives both back.
    A fit that would price a second negatively falls back to the per-token median."""
    from bench.simulate.calibrate import floating_cpu

    def point(tokens: int, wall: float) -> dict:
        return {"metrics": {"total_output_tokens": tokens}, "cpu_wall_s": wall,
                "float_cpu": {"client": {"run_s": 8e-3 * wall + 0.3e-3 * tokens},
                              "router": {"run_s": 20e-3 * wall + 0.45e-3 * tokens}}}
    measured = {"systems": {"1p1d": {"points": [point(6000, 26.0), point(6000, 50.0), point(5000, 128.0)]}}}
    assert floating_cpu([measured]) == (pytest.approx(0.45e-3), pytest.approx(0.3e-3),
                                              pytest.approx(20e-3), pytest.approx(8e-3))
    shrinking = {"systems": {"1p1d": {"points": [point(1000, 10.0), point(1000, 100.0)]}}}
    shrinking["systems"]["1p1d"]["points"][1]["float_cpu"]["client"]["run_s"] = 0.1
    assert floating_cpu([shrinking])[1::2] == (pytest.approx((0.38 + 0.1) / 2 / 1000), 0.0)


@pytest.mark.parametrize("topology", [Topology(colocated=1), Topology.disaggregated(1, 1)])
def test_the_front_end_costs_more_for_a_longer_prompt(topology):
    """The traces' third finding: a 3k-token RAG prompt reached the router 6-18 ms after it was sent,
    a short one 2-4 ms. With prompt_token_s, a prompt's admission waits request_s + prompt_token_s
    per token: alone, TTFT moves by exactly that (colocated, and a remote prefill's hop included)."""
    base = profile(request_s=0.003)
    per_token = replace(base, overheads=replace(base.overheads, prompt_token_s=2e-6))
    for n in (40, 1000):
        ttfts = []
        for p in (base, per_token):
            r = request(0, tokens(n), 2)
            simulate(p, [r], topology)
            ttfts.append(r.ttft)
        assert ttfts[1] - ttfts[0] == pytest.approx(2e-6 * n)
    assert Overheads(request_s=0.003, prompt_token_s=2e-6).front_s(1000) == pytest.approx(0.005)


def test_the_simulated_decode_choice_breaks_ties_by_a_coin_not_by_node_order():
    """20 unique prompts, each alone (both decode nodes idle and empty: equal cost): the router
    breaks such ties by a seeded coin (routing_cost.py), so both nodes get some; by node order
    decode-0 took them all, which decided whether a later RAG request found its document's node
    free (bench/README.md, "Two decode nodes on one core")."""
    reqs = [request(i, tokens(40, 1_000 * (i + 1)), 4, at=float(i)) for i in range(20)]
    s = simulate(profile(), reqs, Topology.disaggregated(1, 2))
    busy = {n: b for n, (b, _) in s.node_times.items() if n.startswith("decode")}
    assert min(busy.values()) > 0.2 * max(busy.values())
