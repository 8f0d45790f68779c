"""A step's decoding rows and its prompt rows priced at their own speeds (pdplan/kind_cost.py), and
each node's two factors read from its recorded steps (bench/simulate/node_steps.py kind_speeds)."""
from __future__ import annotations

import pytest

from bench.simulate.node_steps import MIN_PROMPT_STEPS, MIN_STEPS, NodeSpeed, NodeStep, kind_speeds, node_speeds
from pdplan.kind_cost import KindCost, KindSpeed
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens

DECODE = ((1, 100), (1, 300))           # two decoding rows
PROMPT = ((256, 0), (1, 100))           # a 256-token chunk beside one decoding row


def _lines(shape, decode_k: float, prompt_k: float, n: int) -> list[str]:
    """n step lines whose thread CPU is the shape's decode part at decode_k plus its prompt part at prompt_k."""
    d, p = KindCost(STEP, KindSpeed(1.0, 1.0)).parts(list(shape))
    return [NodeStep(3 * (d + p), decode_k * d + prompt_k * p, shape).line() for _ in range(n)]


def test_equal_factors_are_the_scaled_cost_and_a_decode_step_ignores_the_prompt_factor():
    """KindSpeed(k, k) prices every step as StepCost.scaled(k); a decode-only step pays the decode
    factor alone; a mixed step pays each factor on its own part, the two parts summing to the price."""
    for shape in (DECODE, PROMPT, ((64, 32),)):
        assert KindCost(STEP, KindSpeed(1.3, 1.3)).of(list(shape)) == pytest.approx(STEP.scaled(1.3).of(list(shape)))
    assert KindCost(STEP, KindSpeed(1.2, 5.0)).of(list(DECODE)) == pytest.approx(1.2 * STEP.of(list(DECODE)))
    d, p = KindCost(STEP, KindSpeed(1.0, 1.0)).parts(list(PROMPT))
    assert d == pytest.approx(STEP.of([(1, 100)])) and d + p == pytest.approx(STEP.of(list(PROMPT)))
    assert KindCost(STEP, KindSpeed(1.2, 0.9)).of(list(PROMPT)) == pytest.approx(1.2 * d + 0.9 * p)


def test_each_node_gets_its_decode_steps_factor_and_the_points_prompt_factor():
    """decode-0: MIN_STEPS decode steps at 1.25 and 2 mixed prompt steps (decode rows 1.25, prompt
    rows 0.9); prefill-0: 6 prompt-only steps (fixed part 1.25, rows 0.9): decode-0 is 1.25/0.9; prefill-0, with no decode
    step, takes the point's decode factor 1.25 and the same prompt factor 0.9 (8 prompt steps pooled)."""
    steps = {"decode-0": _lines(DECODE, 1.25, 1.0, MIN_STEPS) + _lines(PROMPT, 1.25, 0.9, 2),
             "prefill-0": _lines(((512, 0),), 1.25, 0.9, 6)}
    speeds = kind_speeds(steps, STEP)
    assert speeds["decode-0"] == NodeSpeed(KindSpeed(pytest.approx(1.25, rel=1e-4), pytest.approx(0.9, rel=1e-4)),
                                           MIN_STEPS + 2, "node")
    assert speeds["prefill-0"] == NodeSpeed(KindSpeed(pytest.approx(1.25, rel=1e-4), pytest.approx(0.9, rel=1e-4)),
                                            6, "point")
    assert node_speeds(steps, STEP, "cpu")["decode-0"].factor == pytest.approx(1.25, rel=1e-4)   # one factor: the old


def test_too_few_prompt_steps_leave_the_prompt_rows_at_the_decode_factor():
    """With MIN_PROMPT_STEPS - 1 prompt steps in the point, a node's prompt factor is its decode factor."""
    steps = {"decode-0": _lines(DECODE, 1.1, 1.0, MIN_STEPS) + _lines(PROMPT, 1.1, 0.7, MIN_PROMPT_STEPS - 1)}
    k = kind_speeds(steps, STEP)["decode-0"].factor
    assert k == KindSpeed(pytest.approx(1.1, rel=1e-4), pytest.approx(1.1, rel=1e-4))


def test_a_prompt_factor_below_the_decode_one_shortens_the_prefill_and_not_the_decode_steps():
    """1P+1D, one request: prefill-0 at KindSpeed(1.5, 0.8) takes 0.8 of its one chunk's price (the
    TTFT shrinks by 0.2 of it); decode-0 at KindSpeed(1.5, 0.8) has each token gap at 1.5x."""
    def run(speed):
        r = request(0, tokens(100), 6)
        return simulate(profile(), [r], Topology.disaggregated(1, 1), speed=speed), r
    (_, r0), (_, r1) = run(None), run({"prefill-0": KindSpeed(1.5, 0.8), "decode-0": KindSpeed(1.5, 0.8)})
    chunk = STEP.of([(100, 0)])
    fixed = STEP.of([])
    assert r1.ttft == pytest.approx(r0.ttft - 0.2 * (chunk - fixed) + 0.5 * fixed)
    gaps = lambda r: [b - a for a, b in zip(r.token_times[1:], r.token_times[2:])]     # noqa: E731
    assert gaps(r1) == pytest.approx([1.5 * g for g in gaps(r0)])
