"""What a server's step loop costs its engine beyond its steps (bench/simulate/loop_cost.py), read
off scripted traces, and the simulated colocated engine charging it (pdplan Overheads.colocated_*)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.simulate.loop_cost import colocated_extra, loop_cost
from pdplan.profile import Overheads
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens


def _trace(tmp_path, name: str, role: str, lost_ms: float, admit_ms: float, admit_ms_per_token: float) -> str:
    """A traced point: one warm-up request, then a busy loop of 12 steps (10 ms of CPU, each
    losing `lost_ms` to its stretch and the gap after it), among which 4 start a request of
    100, 200, 300 and 400 prompt tokens, losing admit_ms + admit_ms_per_token per prompt token
    more; then a 1 s pause (a loop waiting for work)."""
    d = tmp_path / name
    d.mkdir()
    events = [{"t": 0.0, "p": "router", "e": "gen_start", "rid": "warm"}, {"t": 0.01, "p": "router", "e": "gen_start", "rid": "r0"}]
    t = 0.02
    for i in range(12):
        prompt = 100 * (i // 3 + 1) if i % 3 == 0 else 0
        lost = (lost_ms + (admit_ms + admit_ms_per_token * prompt if prompt else 0)) / 1e3
        chunks, shapes = ([[f"r{i}", prompt]], [[prompt, 0]]) if prompt else ([], [[1, 50]])
        events.append({"t": t + 0.010 + lost / 2, "p": role, "e": "step", "t0": t, "cpu": 0.010, "chunks": chunks,
                       "shapes": shapes, "out": [f"r{i}"], "seqs": 1, "tokens": prompt or 1})
        t += 0.010 + lost
    events.append({"t": t + 1.010, "p": role, "e": "step", "t0": t + 1.0, "cpu": 0.010, "chunks": [], "shapes": [[1, 60]],
                   "out": [], "seqs": 1, "tokens": 1})
    (d / "1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (d / "measured.json").write_text(json.dumps({"warmup_requests": 1, "points": []}))
    return str(d)


def test_the_loop_loses_per_step_and_per_prompt_token_of_a_request_it_starts(tmp_path):
    """Each busy step's lost time (stretch + gap to the next) is read back: 0.5 ms a step, and
    2 ms + 10 us per prompt token more for a step that starts a request; the last step, followed
    by the 1 s wait for work, is not read."""
    cost = loop_cost([_trace(tmp_path, "c", "router", 0.5, 2.0, 0.010)], "router")
    assert cost.per_step_s == pytest.approx(0.0005)
    assert (cost.admit_s, cost.admit_token_s) == pytest.approx((0.002, 1e-5))
    assert (cost.steps, cost.admissions) == (11, 4)


def test_what_a_colocated_loop_loses_beyond_a_decode_nodes_is_the_difference_and_never_below_zero(tmp_path):
    """Colocated 0.8 ms a step, 3 ms and 10 us a prompt token more at admission; a decode node
    0.5 ms, 1 ms and 12 us: the colocated extra is 0.3 ms a step, 2 ms a request, nothing per
    prompt token (not -2 us)."""
    extra = colocated_extra([_trace(tmp_path, "c", "router", 0.8, 3.0, 0.010)],
                            [_trace(tmp_path, "d", "decode-0", 0.5, 1.0, 0.012)])
    assert extra == pytest.approx((0.0003, 0.002, 0.0))


def test_the_simulated_colocated_engine_adds_its_loop_cost_to_its_steps():
    """One request alone, colocated: its first step costs its price, plus 1 ms for the step, plus
    2 ms + 10 us x 100 prompt tokens for the request it starts; every later step 1 ms more than
    its price. A disaggregated run is not charged (a decode node's loop is in the calibration)."""
    base = profile()
    p = replace(base, overheads=Overheads(colocated_step_s=0.001, colocated_admit_s=0.002, colocated_admit_token_s=1e-5))
    for prof, extra in ((base, 0.0), (p, 0.001)):
        r = request(0, tokens(100), 3)
        simulate(prof, [r], Topology(colocated=1))
        assert r.ttft == pytest.approx(STEP.of([(100, 0)]) + extra + (0.003 if extra else 0.0))
        assert r.token_times[1] - r.token_times[0] == pytest.approx(STEP.of([(1, 100)]) + extra)
    a, b = request(0, tokens(100), 3), request(0, tokens(100), 3)
    simulate(base, [a], Topology.disaggregated(1, 1))
    simulate(p, [b], Topology.disaggregated(1, 1))
    assert a.token_times == pytest.approx(b.token_times)
