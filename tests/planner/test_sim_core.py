"""Nodes pinned to one core time-share it (processor sharing): closed-form cases for SimCore, and a
shared-core 1P+2D against the same deployment on dedicated cores."""
from __future__ import annotations

import pytest

from bench.simulate.pinning import PINS
from bench.simulate.validate import topology
from pdplan.events import EventLoop
from pdplan.sim_core import CoreMap, SimCore
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import profile, request, tokens


def _run(core: SimCore, loop: EventLoop, starts: list[tuple[float, float]]) -> list[float]:
    """Steps (start time, work) on `core`; returns when each ended."""
    ends = [0.0] * len(starts)
    for i, (at, work) in enumerate(starts):
        loop.at(at, lambda i=i, work=work: core.run(work, lambda: ends.__setitem__(i, loop.now)))
    loop.run()
    return ends


def test_a_step_alone_takes_its_work():
    """One step on an idle core ends exactly its work later."""
    loop = EventLoop()
    assert _run(SimCore(loop), loop, [(1.0, 0.25)]) == [pytest.approx(1.25)]


def test_two_steps_at_once_each_advance_at_half_speed():
    """Two equal steps started together both end at twice the work."""
    loop = EventLoop()
    assert _run(SimCore(loop), loop, [(0.0, 0.1), (0.0, 0.1)]) == [pytest.approx(0.2)] * 2


def test_a_step_joining_midway_stretches_only_the_overlap():
    """80 ms from 0, 80 ms from 40 ms: the first has 40 ms left at half speed (ends at 120 ms), the
    second 40 ms done by then and its last 40 ms alone (ends at 160 ms)."""
    loop = EventLoop()
    assert _run(SimCore(loop), loop, [(0.0, 0.08), (0.04, 0.08)]) == [pytest.approx(0.12), pytest.approx(0.16)]


def test_the_core_map_shares_only_pinned_names():
    """Names pinned to one core id get one SimCore; unpinned names a core each."""
    cores = CoreMap(EventLoop(), (("decode-0", 1), ("decode-1", 1), ("prefill-0", 0)))
    assert cores.of("decode-0") is cores.of("decode-1")
    assert cores.of("prefill-0") is not cores.of("decode-0")
    assert cores.of("decode-2") is not cores.of("decode-3")


def test_two_decode_nodes_on_one_core_double_the_time_between_tokens():
    """Two requests on the two decode nodes of 1P+2D: every gap that falls while both decode is
    twice the same gap on dedicated cores; outside that window gaps are as on dedicated cores."""
    def timelines(topo: Topology) -> list[list[float]]:
        reqs = [request(i, tokens(96, 3 + 100 * i), 40) for i in range(2)]   # > 64 tokens: via the prefill node
        simulate(profile(), reqs, topo)
        return [r.token_times for r in reqs]
    own, shared = timelines(Topology.disaggregated(1, 2)), timelines(topology("1p2d", {}))
    start, end = shared[1][1], shared[0][-1]            # both decoding: from the second's first step
    pairs = [(b - a, own[r][k + 1] - own[r][k]) for r in (0, 1)
             for k, (a, b) in enumerate(zip(shared[r][1:], shared[r][2:]), start=1) if start < a and b < end]
    assert len(pairs) >= 10
    assert [s for s, _ in pairs] == [pytest.approx(2 * o, rel=0.03) for _, o in pairs]
    assert shared[0][:2] == pytest.approx(own[0][:2])   # before the second arrives: alone, full speed


def test_the_validation_topology_is_the_measured_pinning():
    """validate simulates 1P+2D with both decodes on one core, as measure pins them; 1P+1D shares nothing."""
    assert PINS["1p2d"]["decode-0"] == PINS["1p2d"]["decode-1"]
    assert topology("1p2d", {}).shared() == [["decode-0", "decode-1"]]
    assert topology("1p1d", {}).shared() == []
    assert str(topology("1p2d", {"cores": None})) == "1P+2D (decode-0+decode-1 on one core)"


def test_a_lone_node_on_a_pinned_core_runs_as_on_its_own():
    """Pinning with nothing to share changes nothing: 1P+1D pinned gives the same timeline as unpinned."""
    def times(topo: Topology) -> list[float]:
        r = request(0, tokens(100), 5)
        simulate(profile(), [r], topo)
        return r.token_times
    assert times(topology("1p1d", {})) == pytest.approx(times(Topology.disaggregated(1, 1)))


def test_background_load_slows_every_step_by_its_share():
    """One background process on the core: a lone 100 ms step takes 200 ms; two steps 300 ms each."""
    loop = EventLoop()
    assert _run(SimCore(loop, background=1.0), loop, [(0.0, 0.1)]) == [pytest.approx(0.2)]
    loop = EventLoop()
    assert _run(SimCore(loop, background=1.0), loop, [(0.0, 0.1), (0.0, 0.1)]) == [pytest.approx(0.3)] * 2


def test_the_contention_fit_recovers_a_known_background():
    """Waits simulated under b = 0.6 on core 1 and 0 on core 0, read back as measured: the fit finds them."""
    from bench.simulate.contention import fit_background, simulated_wait
    cores = {"prefill-0": [0], "decode-0": [1], "decode-1": [1]}
    topo = topology("1p2d", {"cores": cores})
    reqs = [request(i, tokens(64, 3 + 100 * i), 30, at=0.05 * i) for i in range(6)]
    run = lambda b: simulate(profile(), reqs, topo, background=b)          # noqa: E731
    truth = run({0: 0.0, 1: 0.6})
    target = {c: simulated_wait(truth, cores, c) for c in (0, 1)}
    assert target[1] > 0.6 and target[0] == pytest.approx(0.0)
    fitted = fit_background(run, target, cores)
    assert fitted[0] == 0.0 and fitted[1] == pytest.approx(0.6, abs=0.01)


def test_a_decode_node_waiting_for_its_blocks_leaves_its_core_to_its_neighbour():
    """1P+2D on the validation's pinning: while one decode node waits for a long prompt's blocks (its
    loop sleeps until a frame lands: node_shell/runtime.py), the other decode node's steps on the same
    core take their price, as on cores of their own."""
    def run(topo: Topology):
        reqs = [request(0, tokens(20), 200), request(1, tokens(1000, 5000), 3, at=0.3)]
        simulate(profile(), reqs, topo)
        return reqs
    streamer, remote = run(topology("1p2d", {}))
    own_streamer, _ = run(Topology.disaggregated(1, 2))
    assert streamer.decode_node != remote.decode_node
    wait = (remote.arrival + 0.05, remote.token_times[0] - 0.05)      # the remote prompt on the prefill node
    inside = lambda r: [b - a for a, b in zip(r.token_times, r.token_times[1:]) if wait[0] < a and b < wait[1]]  # noqa: E731
    gaps = inside(streamer)
    assert len(gaps) >= 10 and gaps == pytest.approx(inside(own_streamer))
