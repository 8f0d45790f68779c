"""The simulator against closed-form cases: one request alone, a saturated decode batch, prefix
hits, preemption when KV runs out, and block conservation at the end of every run."""
from __future__ import annotations

import pytest

from pdplan.profile import Overheads, Profile, StepCost, Transfer
from pdplan.sim_request import SimRequest, chain_hashes
from pdplan.simulation import SLOTargets, Topology, simulate

STEP = StepCost(fixed=0.010, per_token=0.001, per_seq=0.0005, per_decode_ctx=1e-5, per_prefill_pair=1e-7)


def profile(num_blocks: int = 1024, budget: int = 512, max_seqs: int = 64, request_s: float = 0.0) -> Profile:
    return Profile({}, {}, 16, num_blocks, max_seqs, budget, STEP, Transfer(0.002, 0.0005, 1 << 19),
                   Overheads(request_s=request_s))


def request(rid: int, prompt: tuple[int, ...], output: int, at: float = 0.0) -> SimRequest:
    return SimRequest(rid, at, len(prompt), output, chain_hashes(prompt, 16))


def tokens(n: int, start: int = 3) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_one_request_disaggregated_ttft_is_prefill_and_second_token_waits_for_the_transfer():
    """Alone: TTFT = request overhead + one prefill step; token 2 = TTFT + every block on the link + commit + one decode step."""
    p = profile(request_s=0.003)
    r = request(0, tokens(100), 4)
    simulate(p, [r], Topology.disaggregated(1, 1))
    prefill = STEP.of([(100, 0)])
    assert r.ttft == pytest.approx(0.003 + prefill)
    blocks = 7                                              # 100 tokens: 6 full blocks + the partial one
    commit = r.token_times[0] + blocks * 0.002 + 0.0005
    assert r.token_times[1] == pytest.approx(commit + STEP.of([(1, 100)]))
    assert r.token_times[2] - r.token_times[1] == pytest.approx(STEP.of([(1, 101)]))


def test_one_request_colocated_chunks_its_prompt_under_the_budget():
    """A 1,200-token prompt at a 512-token budget: three chunks, then decode steps one after another."""
    r = request(0, tokens(1200), 3)
    simulate(profile(budget=512), [r], Topology(colocated=1))
    chunks = STEP.of([(512, 0)]) + STEP.of([(512, 512)]) + STEP.of([(176, 1024)])
    assert r.ttft == pytest.approx(chunks)
    assert r.tpot == pytest.approx((STEP.of([(1, 1200)]) + STEP.of([(1, 1201)])) / 2)


def test_saturated_decode_batch_tpot_is_the_step_time_at_that_batch():
    """B requests decoding together: every gap between tokens is the step time at batch B."""
    b = 8
    flat = StepCost(fixed=0.010, per_token=0.001, per_seq=0.0005, per_decode_ctx=0.0, per_prefill_pair=0.0)
    p = Profile({}, {}, 16, 1024, 64, 4096, flat, Transfer(0.002, 0.0005, 1 << 19))
    reqs = [request(i, tokens(32, 3 + 100 * i), 50) for i in range(b)]
    simulate(p, reqs, Topology(colocated=1))
    batch_step = flat.of([(1, 0)] * b)
    for r in reqs:      # the first request is prefilled alone, the other 7 join a step later
        gaps = [t1 - t0 for t0, t1 in zip(r.token_times[2:-1], r.token_times[3:-1])]   # the last: one gone
        assert gaps == [pytest.approx(batch_step)] * len(gaps)


def test_a_cached_prefix_is_not_computed_again():
    """The second prompt sharing 64 tokens (4 full blocks) computes only the rest, over that context."""
    doc = tokens(64)
    first, second = request(0, doc + tokens(20, 500), 1), request(1, doc + tokens(20, 900), 1, at=1.0)
    simulate(profile(), [first, second], Topology(colocated=1))
    assert second.ttft == pytest.approx(STEP.of([(20, 64)]))


def test_a_question_on_a_cached_document_pays_for_reading_it():
    """With a context term, the second prompt's step costs its 20 tokens, their pairs and one
    read of the 64 cached tokens: fixed + 20 x token + seq + 20 x (64 + 10.5) pairs + 64 x ctx."""
    doc = tokens(64)
    step = StepCost(fixed=0.010, per_token=0.001, per_seq=0.0005, per_decode_ctx=1e-5, per_prefill_pair=1e-7,
                    per_prefill_ctx=2e-5)
    p = Profile({}, {}, 16, 1024, 64, 512, step, Transfer(0.002, 0.0005, 1 << 19))
    first, second = request(0, doc + tokens(20, 500), 1), request(1, doc + tokens(20, 900), 1, at=1.0)
    simulate(p, [first, second], Topology(colocated=1))
    assert second.ttft == pytest.approx(0.010 + 20 * 0.001 + 0.0005 + 20 * 74.5 * 1e-7 + 64 * 2e-5)


def test_kv_exhaustion_preempts_and_every_request_still_completes():
    """A pool of 24 blocks for 6 growing sequences: preemption by recompute, all finish, nothing leaks."""
    reqs = [request(i, tokens(40, 3 + 100 * i), 60) for i in range(6)]
    summary = simulate(profile(num_blocks=24, budget=4096), reqs, Topology(colocated=1))
    assert summary.preemptions > 0
    assert summary.completed == 6 and all(len(r.token_times) == 60 for r in reqs)


def test_busy_decode_nodes_make_requests_wait_and_all_complete():
    """Decode nodes too small for every reservation at once: the router waits for room, nothing fails."""
    reqs = [request(i, tokens(48, 3 + 100 * i), 40, at=0.001 * i) for i in range(8)]
    summary = simulate(profile(num_blocks=10, budget=4096), reqs, Topology.disaggregated(1, 2))
    assert summary.admission_waits > 0
    assert summary.completed == 8


def test_blocks_are_conserved_after_a_run():
    """After every request ends, each node's pool holds nothing in use (only cached prefix blocks)."""
    from pdplan.colocated import ColocatedPool
    from pdplan.events import EventLoop
    loop = EventLoop()
    pool = ColocatedPool(2, profile(num_blocks=40, budget=256), loop)
    reqs = [request(i, tokens(70, 3 + 7 * i), 30, at=0.01 * i) for i in range(10)]
    for r in reqs:
        loop.at(r.arrival, lambda r=r: pool.submit(r))
    loop.run()
    for node in pool.nodes:
        node.engine.pool.check_integrity()
        assert node.engine.pool.used == 0 and not node.engine.running and not node.engine.waiting
    assert all(r.done for r in reqs)


def test_slo_attainment_counts_ttft_and_tpot():
    """A TTFT SLO below the lone prefill time: attainment 0; above it: 1."""
    r = request(0, tokens(300), 3)
    ttft_ms = STEP.of([(300, 0)]) * 1000
    assert simulate(profile(), [r], Topology(colocated=1), SLOTargets(ttft_ms * 0.9, 1000)).slo_attainment == 0.0
    assert simulate(profile(), [r], Topology(colocated=1), SLOTargets(ttft_ms * 1.1, 1000)).slo_attainment == 1.0


def test_requests_in_the_warmup_run_but_are_not_scored():
    """A cold document's first request (arriving in the warm-up) is left out of the figures; the
    later one, which hits the prefix it cached, is all the summary counts."""
    doc = tokens(64)
    first, second = request(0, doc + tokens(20, 500), 2), request(1, doc + tokens(20, 900), 2, at=1.0)
    s = simulate(profile(), [first, second], Topology(colocated=1), SLOTargets(1000, 1000), warmup_s=0.5)
    assert first.done and (s.requests, s.completed) == (1, 1)
    assert s.ttft_ms.p50 == pytest.approx(second.ttft * 1000) and second.ttft < first.ttft


def test_a_short_uncached_tail_is_prefilled_on_the_decode_node():
    """40 tokens (<= 64 uncached): the decode node prefills it (the router's local prefill), the prefill
    pool stays idle and nothing crosses the link; a 100-token prompt goes through the prefill node."""
    short = request(0, tokens(40), 3)
    s = simulate(profile(request_s=0.003), [short], Topology.disaggregated(1, 1))
    assert s.utilization["prefill"] == 0.0
    assert short.ttft == pytest.approx(0.003 + STEP.of([(40, 0)]))
    assert short.token_times[1] - short.token_times[0] == pytest.approx(STEP.of([(1, 40)]))
    long = request(1, tokens(100), 3)
    assert simulate(profile(), [long], Topology.disaggregated(1, 1)).utilization["prefill"] > 0


def test_the_prefill_hop_cost_is_charged_only_to_prompts_sent_to_a_prefill_node():
    """handoff_s (PrefillRequest out, FirstToken back) delays a remote prefill, not a local one."""
    from dataclasses import replace
    p = replace(profile(), overheads=Overheads(request_s=0.003, handoff_s=0.020))
    short, long = request(0, tokens(40), 2), request(1, tokens(100, 500), 2, at=5.0)
    simulate(p, [short, long], Topology.disaggregated(1, 1))
    assert short.ttft == pytest.approx(0.003 + STEP.of([(40, 0)]))
    assert long.ttft == pytest.approx(0.003 + 0.020 + STEP.of([(100, 0)]))
