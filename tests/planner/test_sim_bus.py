"""The cores of one machine share its memory bus (pdplan/sim_bus.py): a step on one core costs
`beside_prefill` times its price while another core runs a prefill step; closed-form cases on
SimCores, a pinned 1P+1D against the same on separate hosts, and the factor read off traces
(bench/simulate/bus_cost.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.simulate.bus_cost import beside_prefill, point_factor
from bench.simulate.validate import topology
from pdplan.events import EventLoop
from pdplan.profile import Overheads
from pdplan.sim_bus import SharedBus
from pdplan.sim_core import CoreMap, SimCore
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens


def _steps(cores: CoreMap, loop: EventLoop, steps: list[tuple[int, float, float, bool]]) -> list[float]:
    """Steps (core id, start, work, prefill) on a 2-core machine's cores; when each ended."""
    ends = [0.0] * len(steps)
    for i, (core, at, work, prefill) in enumerate(steps):
        loop.at(at, lambda i=i, c=cores.floating.cores[core], w=work, p=prefill:
                c.run(w, lambda: ends.__setitem__(i, loop.now), f"node-{i}", p))
    loop.run()
    return ends


def test_a_step_is_dearer_only_while_the_other_core_prefills():
    """A 100 ms decode step from 0 on core 1 and a 1 s prefill step from 50 ms on core 0, factor 1.1:
    the decode step's last 50 ms of price take 55 ms (ends at 105 ms, 5 ms of core time beyond its
    price); the prefill step is not slowed by a decode step (ends at 1.05 s)."""
    loop = EventLoop()
    cores = CoreMap(loop, machine_cores=2, beside_prefill=1.1)
    assert _steps(cores, loop, [(1, 0.0, 0.1, False), (0, 0.05, 1.0, True)]) == [pytest.approx(0.105), pytest.approx(1.05)]
    assert cores.floating.cores[1].bus_cpu == {"node-0": pytest.approx(0.005)}
    assert cores.floating.cores[0].bus_cpu == {}


def test_a_step_runs_at_its_price_again_once_the_prefill_ends():
    """A prefill step 0-100 ms on core 0; a decode step of 100 ms from 50 ms on core 1, factor 1.1:
    by 100 ms it has done 50/1.1 ms of its price, the rest alone: it ends at 100 + (100 - 50/1.1) ms."""
    loop = EventLoop()
    cores = CoreMap(loop, machine_cores=2, beside_prefill=1.1)
    ends = _steps(cores, loop, [(0, 0.0, 0.1, True), (1, 0.05, 0.1, False)])
    assert ends == [pytest.approx(0.1), pytest.approx(0.1 + 0.1 - 0.05 / 1.1)]
    assert all(core.slow == 1.0 and core.prefilling == 0 for core in cores.floating.cores)


def test_two_prefills_slow_each_other_and_a_core_never_slows_itself():
    """Prefill steps of 100 ms on both cores from 0: each ends at 110 ms; two on one core share it
    (200 ms each) at their price: a core's own prefill does not make it dearer."""
    loop = EventLoop()
    cores = CoreMap(loop, machine_cores=2, beside_prefill=1.1)
    assert _steps(cores, loop, [(0, 0.0, 0.1, True), (1, 0.0, 0.1, True)]) == [pytest.approx(0.11)] * 2
    loop = EventLoop()
    cores = CoreMap(loop, machine_cores=2, beside_prefill=1.1)
    assert _steps(cores, loop, [(0, 0.0, 0.1, True), (0, 0.0, 0.1, True)]) == [pytest.approx(0.2)] * 2


def test_no_machine_no_bus():
    """Separate hosts (no machine's cores), or a factor of 1: no core is tied to a bus; a factor
    below 1 is refused."""
    loop = EventLoop()
    assert CoreMap(loop, (("prefill-0", 0), ("decode-0", 1))).of("decode-0").bus is None
    assert CoreMap(loop, machine_cores=2).floating.cores[0].bus is None
    with pytest.raises(ValueError):
        SharedBus([SimCore(loop)], 0.9)


def test_a_streaming_node_beside_a_long_prefill_on_one_machine():
    """1P+1D pinned on the validation's 2-core machine, factor 1.1: a request streaming on the
    decode node while the prefill node prefills a 1,000-token prompt gets its tokens 1.1x as far
    apart as with factor 1, and its decode node's core time grows; on separate hosts the factor
    changes no token's time."""
    def run(topo: Topology, factor: float):
        p = profile()
        p = replace(p, overheads=replace(p.overheads, beside_prefill=factor))
        reqs = [request(0, tokens(20), 200), request(1, tokens(1000, 5000), 3, at=0.3)]
        return reqs, simulate(p, reqs, topo)
    pinned = topology("1p1d", {}, machine_cores=2)
    (slow, remote), dear = run(pinned, 1.1)
    (fast, _), cheap = run(pinned, 1.0)
    prefill = (remote.arrival + 0.05, remote.arrival + STEP.of([(512, 0)]))     # its first chunk runs meanwhile
    inside = lambda r: [b - a for a, b in zip(r.token_times, r.token_times[1:]) if prefill[0] < a and b < prefill[1]]  # noqa: E731
    assert len(inside(fast)) >= 5
    assert inside(slow)[:5] == [pytest.approx(1.1 * g, rel=0.005) for g in inside(fast)[:5]]
    assert dear.node_times["decode-0"][0] > cheap.node_times["decode-0"][0]
    assert dear.node_times["prefill-0"][0] == pytest.approx(cheap.node_times["prefill-0"][0])
    (own_slow, _), _ = run(Topology.disaggregated(1, 1), 1.1)
    (own_fast, _), _ = run(Topology.disaggregated(1, 1), 1.0)
    assert own_slow.token_times == own_fast.token_times


def _trace(tmp_path, name: str, beside: float) -> str:
    """A traced 1P+1D point: 10 decode steps alone (CPU at 1.02x their price) and 10 inside the
    prefill node's steps (at beside x 1.02), and one half inside (not read)."""
    d = tmp_path / name
    d.mkdir()
    price = STEP.of([(1, 50)])
    events = []
    for i in range(10):
        events.append({"t": i + 0.1, "p": "decode-0", "e": "step", "t0": float(i), "cpu": 1.02 * price, "shapes": [[1, 50]]})
        events.append({"t": 20 + i + 0.1, "p": "decode-0", "e": "step", "t0": 20.0 + i, "cpu": beside * 1.02 * price,
                       "shapes": [[1, 50]]})
        events.append({"t": 20 + i + 0.5, "p": "prefill-0", "e": "step", "t0": 20.0 + i - 0.5, "cpu": 1.0, "shapes": [[512, 0]]})
    events.append({"t": 40.1, "p": "decode-0", "e": "step", "t0": 40.0, "cpu": 9.0, "shapes": [[1, 50]]})
    events.append({"t": 40.05, "p": "prefill-0", "e": "step", "t0": 39.0, "cpu": 1.0, "shapes": [[512, 0]]})
    (d / "1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(d)


def test_the_factor_is_read_off_traces_as_a_ratio_of_ratios(tmp_path):
    """Per point, beside / alone of the decode steps' CPU over price (the machine's 1.02 cancels);
    over points, the median; a point with too few steps gives none; never below 1."""
    p = profile()
    dirs = [_trace(tmp_path, f"t{i}", k) for i, k in enumerate((1.05, 1.12, 1.15))]
    assert point_factor(dirs[1], p).factor == pytest.approx(1.12)
    assert point_factor(dirs[1], p)[2:] == (10, 10)
    factor, points = beside_prefill(dirs, p)
    assert factor == pytest.approx(1.12) and len(points) == 3
    (tmp_path / "empty").mkdir()
    assert point_factor(str(tmp_path / "empty"), p) is None
    assert beside_prefill([_trace(tmp_path, "fast", 0.9)], p)[0] == 1.0
    assert Overheads().beside_prefill == 1.0
