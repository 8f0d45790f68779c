"""A step's decoding rows, its short and its long prompt chunks priced at their own speeds
(pdplan/kind_cost.py), and each node's factors read from its recorded steps (bench/simulate/node_steps.py
kind_speeds)."""
from __future__ import annotations

import pytest

from bench.simulate.node_steps import MIN_PROMPT_STEPS, MIN_STEPS, NodeSpeed, NodeStep, kind_speeds, node_speeds
from pdplan.kind_cost import LONG_CHUNK, KindCost, KindSpeed
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens

DECODE = ((1, 100), (1, 300))           # two decoding rows
PROMPT = ((256, 0), (1, 100))           # a 256-token chunk (a long one) beside one decoding row
QUESTION = ((32, 2000), (1, 100))       # a 32-token chunk over 2,000 cached tokens (a short one) beside one


def _lines(shape, decode_k: float, prompt_k: float, n: int) -> list[str]:
    """n step lines whose thread CPU is the shape's decode part at decode_k plus its prompt part at prompt_k."""
    parts = KindCost(STEP, KindSpeed(1.0, 1.0)).parts(list(shape))
    d, p = parts.decode, parts.prompt
    return [NodeStep(3 * (d + p), decode_k * d + prompt_k * p, shape).line() for _ in range(n)]


def test_equal_factors_are_the_scaled_cost_and_a_decode_step_ignores_the_prompt_factor():
    """KindSpeed(k, k) prices every step as StepCost.scaled(k); a decode-only step pays the decode
    factor alone; a mixed step pays each factor on its own part, the two parts summing to the price."""
    for shape in (DECODE, PROMPT, ((64, 32),)):
        assert KindCost(STEP, KindSpeed(1.3, 1.3)).of(list(shape)) == pytest.approx(STEP.scaled(1.3).of(list(shape)))
    assert KindCost(STEP, KindSpeed(1.2, 5.0)).of(list(DECODE)) == pytest.approx(1.2 * STEP.of(list(DECODE)))
    d, _, p = KindCost(STEP, KindSpeed(1.0, 1.0)).parts(list(PROMPT))
    assert d == pytest.approx(STEP.of([(1, 100)])) and d + p == pytest.approx(STEP.of(list(PROMPT)))
    assert KindCost(STEP, KindSpeed(1.2, 0.9)).of(list(PROMPT)) == pytest.approx(1.2 * d + 0.9 * p)


def test_each_node_gets_its_decode_steps_factor_and_the_points_prompt_factor():
    """decode-0: MIN_STEPS decode steps at 1.25 and 2 mixed prompt steps (decode rows 1.25, prompt
    rows 0.9); prefill-0: 6 prompt-only steps (fixed part 1.25, rows 0.9): decode-0 is 1.25/0.9; prefill-0, with no decode
    step, takes the point's decode factor 1.25 and the same prompt factor 0.9 (8 prompt steps pooled)."""
    steps = {"decode-0": _lines(DECODE, 1.25, 1.0, MIN_STEPS) + _lines(PROMPT, 1.25, 0.9, 2),
             "prefill-0": _lines(((512, 0),), 1.25, 0.9, 6)}
    speeds = kind_speeds(steps, STEP)
    k = KindSpeed(pytest.approx(1.25, rel=1e-4), pytest.approx(0.9, rel=1e-4), pytest.approx(0.9, rel=1e-4))
    assert speeds["decode-0"] == NodeSpeed(k, MIN_STEPS + 2, "node")
    assert speeds["prefill-0"] == NodeSpeed(k, 6, "point")
    assert node_speeds(steps, STEP, "cpu")["decode-0"].factor == pytest.approx(1.25, rel=1e-4)   # one factor: the old


def test_too_few_prompt_steps_leave_the_prompt_rows_at_the_decode_factor():
    """With MIN_PROMPT_STEPS - 1 prompt steps in the point, a node's prompt factor is its decode factor."""
    steps = {"decode-0": _lines(DECODE, 1.1, 1.0, MIN_STEPS) + _lines(PROMPT, 1.1, 0.7, MIN_PROMPT_STEPS - 1)}
    k = kind_speeds(steps, STEP)["decode-0"].factor
    assert k == KindSpeed(pytest.approx(1.1, rel=1e-4), pytest.approx(1.1, rel=1e-4), pytest.approx(1.1, rel=1e-4))


def test_a_step_pays_each_kind_of_row_at_its_own_factor():
    """A step with a decoding row, a short chunk and a long one pays decode, prompt and long on the
    three parts, which sum to the price; without a long factor the long rows pay the prompt one."""
    shape = [(1, 100), (32, 2000), (LONG_CHUNK, 0)]
    d, s, lg = KindCost(STEP, KindSpeed(1.0, 1.0)).parts(shape)
    assert d == pytest.approx(STEP.of([(1, 100)])) and s == pytest.approx(STEP.of([(32, 2000)]) - STEP.of([]))
    assert d + s + lg == pytest.approx(STEP.of(shape)) and lg > 0
    assert KindCost(STEP, KindSpeed(1.2, 0.8, 1.1)).of(shape) == pytest.approx(1.2 * d + 0.8 * s + 1.1 * lg)
    assert KindCost(STEP, KindSpeed(1.2, 0.8)).of(shape) == pytest.approx(1.2 * d + 0.8 * (s + lg))


def test_short_and_long_chunks_get_the_medians_of_their_own_steps():
    """A point with MIN_PROMPT_STEPS question steps at 0.8 and as many long-chunk steps at 1.1: the
    short chunks are priced 0.8 and the long ones 1.1 (one pooled median would give both one figure);
    with one long step fewer, the long chunks take the median over every prompt step."""
    questions = _lines(QUESTION, 1.2, 0.8, MIN_PROMPT_STEPS)
    steps = {"decode-0": _lines(DECODE, 1.2, 1.0, MIN_STEPS) + questions,
             "prefill-0": _lines(((2048, 0),), 1.2, 1.1, MIN_PROMPT_STEPS)}
    k = kind_speeds(steps, STEP)["decode-0"].factor
    assert k == KindSpeed(pytest.approx(1.2, rel=1e-4), pytest.approx(0.8, rel=1e-4), pytest.approx(1.1, rel=1e-4))
    steps["prefill-0"] = steps["prefill-0"][1:]
    pooled = kind_speeds(steps, STEP)["prefill-0"].factor
    assert pooled.long == pytest.approx(0.8, rel=1e-4) and pooled.prompt == pytest.approx(0.8, rel=1e-4)


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


def test_a_long_prompt_is_prefilled_at_the_long_factor_and_a_short_one_at_the_prompt_factor():
    """1P+1D, prefill-0 at KindSpeed(1.0, 0.5, 1.0): a LONG_CHUNK-token prompt's TTFT is the same as at
    1.0 (its one chunk is a long one), a 100-token prompt's shrinks by half its chunk's rows."""
    def ttft(n, speed):
        r = request(0, tokens(n), 2)
        simulate(profile(), [r], Topology.disaggregated(1, 1), speed=speed)
        return r.ttft
    half = {"prefill-0": KindSpeed(1.0, 0.5, 1.0)}
    assert ttft(LONG_CHUNK, half) == pytest.approx(ttft(LONG_CHUNK, None))
    assert ttft(100, half) == pytest.approx(ttft(100, None) - 0.5 * (STEP.of([(100, 0)]) - STEP.of([])))
