"""Each node's engine steps, recorded during a point (bench/simulate/node_steps.py), and each simulated
node priced at its own speed from them (validate --node-speed; simulate(speed=...))."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.simulate.node_steps import MIN_STEPS, NodeSpeed, NodeStep, only, point_speeds, read
from bench.simulate.trace import HOOK
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENGINE_RUN = """
import time
from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from pdwire.sampling_params import SamplingParams
engine = LLMEngine(EngineArgs(dtype="float32", num_blocks=64, max_num_seqs=4,
                              max_num_batched_tokens=32).engine_config())
print(time.monotonic(), flush=True)
engine.add_request("a", list(range(3, 43)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
steps = 0
while engine.has_unfinished_requests():
    engine.step()
    steps += 1
print(time.monotonic(), steps, flush=True)
"""


def test_a_real_engine_under_the_measure_hook_records_every_step_with_its_shapes(tmp_path):
    """The built-in engine in a process started as measure.py starts a node (the trace hook on its
    path, its step record alone): a 40-token prompt at a 32-token budget and 4 output tokens are 5
    steps, each recorded with its exact (new tokens, context) and a positive wall and CPU time, under
    the node's name; read as a colocated run, the same steps are colocated-0's."""
    env = os.environ | {"PYTHONPATH": f"{REPO}:{HOOK}", "PDSERVE_TRACE_DIR": str(tmp_path),
                        "PDSERVE_TRACE_ONLY": only("1p1d"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ENGINE_RUN, "--node-id", "decode-0"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True).stdout.split("\n")
    t0, (t1, steps) = float(out[-3]), out[-2].split()
    recorded = read(str(tmp_path), "1p1d", t0, float(t1))
    assert list(recorded) == ["decode-0"] and len(recorded["decode-0"]) == int(steps) == 5
    parsed = [NodeStep.parse(x) for x in recorded["decode-0"]]
    assert [s.shapes for s in parsed] == [((32, 0),), ((8, 32),), ((1, 40),), ((1, 41),), ((1, 42),)]
    assert all(s.wall_s > 0 and s.cpu_s > 0 for s in parsed)
    starts = [s.start_s for s in parsed]                # after the point's start, in order, none overlapping
    assert 0 <= starts[0] and all(a + s.wall_s <= b + 1e-4 for a, b, s in zip(starts, starts[1:], parsed))
    assert starts[-1] + parsed[-1].wall_s <= float(t1) - t0 + 1e-4
    assert read(str(tmp_path), "colocated", t0, float(t1)) == {"colocated-0": recorded["decode-0"]}
    assert read(str(tmp_path), "1p1d", float(t1), float(t1) + 1) == {}        # outside the point: none


def _lines(ratios: list[float], shape=((1, 100),), wall_k: float = 3.0) -> list[str]:
    """One step line per ratio: CPU `ratio` times STEP's price, wall `wall_k` times it."""
    price = STEP.of(list(shape))
    return [NodeStep(wall_k * price, r * price, shape).line() for r in ratios]


def test_a_step_line_round_trips():
    """A step's wall, CPU (to the microsecond), every (new, context) pair and its start (to 0.1 ms)
    come back as written; a line without a start (before sim22) reads as start -1."""
    step = NodeStep(0.0123456, 0.0101, ((1, 230), (64, 0)))
    assert NodeStep.parse(step.line()) == NodeStep(0.012346, 0.0101, ((1, 230), (64, 0)), -1.0)
    assert NodeStep.parse(step._replace(start_s=12.34567).line()) == NodeStep(0.012346, 0.0101, ((1, 230), (64, 0)), 12.3457)
    assert NodeStep.parse("0.031794 0.031703 6:0") == NodeStep(0.031794, 0.031703, ((6, 0),))


def test_a_nodes_factor_is_the_median_of_its_steps_and_outliers_do_not_move_it():
    """30 steps at 1.2x their price and 9 at 12x (a core taken away): the factor is 1.2, the mean
    would be 3.7; on the wall basis it is the wall's 3.0."""
    steps = {"decode-0": _lines([1.2] * 30 + [12.0] * 9, ((1, 100), (1, 300)))}
    assert point_speeds(steps, STEP) == {"decode-0": NodeSpeed(pytest.approx(1.2, rel=1e-4), 39, "node")}
    assert point_speeds(steps, STEP, "wall")["decode-0"].factor == pytest.approx(3.0, rel=1e-4)


def test_a_node_with_too_few_steps_takes_the_points_median_and_with_too_few_in_all_one():
    """prefill-0 with 3 steps at 2x (fewer than MIN_STEPS) takes the median over every step of the
    point (its 3 and decode-0's MIN_STEPS at 1.1): 1.1; with decode-0's steps too few as well, 1.0."""
    steps = {"prefill-0": _lines([2.0] * 3, ((200, 0),)), "decode-0": _lines([1.1] * MIN_STEPS)}
    speeds = point_speeds(steps, STEP)
    assert speeds["prefill-0"] == NodeSpeed(pytest.approx(1.1, rel=1e-4), 3, "point")
    assert speeds["decode-0"] == NodeSpeed(pytest.approx(1.1, rel=1e-4), MIN_STEPS, "node")
    few = point_speeds({"prefill-0": steps["prefill-0"], "decode-0": steps["decode-0"][:5]}, STEP)
    assert few == {"prefill-0": NodeSpeed(1.0, 3, "none"), "decode-0": NodeSpeed(1.0, 5, "none")}


def test_a_nodes_speed_scales_exactly_its_own_steps():
    """1P+1D, one request: decode-0 at 2x prices every decode step twice as dear (its busy time
    doubles, each token gap too) and leaves prefill-0's steps and the TTFT as they were; prefill-0 at
    1.5x stretches the TTFT by exactly half its one step."""
    def run(speed):
        r = request(0, tokens(100), 6)
        return simulate(profile(), [r], Topology.disaggregated(1, 1), speed=speed), r
    (base, r0), (slow, r1) = run(None), run({"decode-0": 2.0})
    assert slow.node_times["decode-0"][0] == pytest.approx(2 * base.node_times["decode-0"][0])
    assert slow.node_times["prefill-0"][0] == pytest.approx(base.node_times["prefill-0"][0])
    assert r1.ttft == pytest.approx(r0.ttft)
    gaps = lambda r: [b - a for a, b in zip(r.token_times[1:], r.token_times[2:])]     # noqa: E731
    assert gaps(r1) == pytest.approx([2 * g for g in gaps(r0)])
    _, r2 = run({"prefill-0": 1.5})
    assert r2.ttft == pytest.approx(r0.ttft + 0.5 * STEP.of([(100, 0)]))


def test_a_colocated_replicas_speed_scales_its_steps_and_an_unnamed_one_keeps_the_profiles():
    """Two colocated replicas, one request each (two prompts with nothing in common): the replica
    named at 1.5x has its busy time 1.5x the unscaled run's, the other's is unchanged."""
    def run(speed):
        reqs = [request(0, tokens(64), 5), request(1, tokens(64, 5_000), 5)]
        return simulate(profile(), reqs, Topology(colocated=2), speed=speed).node_times
    base, slow = run(None), run({"colocated-1": 1.5})
    assert base["colocated-1"][0] > 0 and base["colocated-0"][0] > 0
    assert slow["colocated-1"][0] == pytest.approx(1.5 * base["colocated-1"][0])
    assert slow["colocated-0"][0] == pytest.approx(base["colocated-0"][0])


def test_outside_steps_is_the_process_cpu_less_its_steps_thread_cpu_per_second_of_the_point():
    """A node's CPU outside its steps: schedstat run less the sum of its steps' thread CPU, and that
    over the point's wall; a node with steps but no schedstat record is left out."""
    from bench.simulate.node_steps import Outside, outside_steps
    point = {"cpu_wall_s": 10.0,
             "cpu": {"decode-0": {"run_s": 2.0, "wait_s": 1.0}},
             "steps": {"decode-0": [NodeStep(0.2, 0.5, ((1, 7),)).line(), NodeStep(0.9, 0.75, ((16, 0),)).line()],
                       "decode-1": [NodeStep(0.1, 0.1, ((1, 3),)).line()]}}
    got = outside_steps(point)
    assert list(got) == ["decode-0"]
    assert got["decode-0"] == pytest.approx(Outside(0.75, 0.075))
