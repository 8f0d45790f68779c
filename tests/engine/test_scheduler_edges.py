"""The scheduler at the edges of its pool and limits: groups of several sequences in pools barely
big enough, swap-in of a group holding most of the pool, max_num_seqs before a group forks,
unchunked prefill, and a copy-on-write planned for a group preempted later in the same step.
Each of these once hung the engine or ended a request early."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.swap import PreemptionMode, SwapPool
from tests.model_factory import hf_greedy, make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _run(llm, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 500) -> dict:
    """Steps to the end (failing on a hang), checking block conservation after every step."""
    for rid, (prompt, params) in requests.items():
        llm.engine.add_request(rid, prompt, params)
    done, most_seqs = {}, 0
    for _ in range(max_steps):
        if not llm.engine.has_unfinished_requests():
            return done
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        llm.engine.check_integrity()
        most_seqs = max(most_seqs, len(llm.engine.scheduler.live_seqs()))
        done["most_seqs"] = most_seqs
    raise AssertionError(f"no end after {max_steps} steps: the engine hangs")


def test_n2_group_alone_in_a_small_pool_runs_to_max_tokens(model_dir, make_llm):
    """Two completions sharing a 20-token prompt's blocks fit 4 blocks of 8: the shared partial
    block costs one copy, not two, so they run to max_tokens (they used to end after 1 token)."""
    params = SamplingParams(n=2, max_tokens=4, **GREEDY)
    prompt = list(range(10, 30))
    small = _run(make_llm(model_dir[0], block_size=8, num_blocks=4, enable_prefix_caching=False),
                 {"a": (prompt, params)})
    big = _run(make_llm(model_dir[0], block_size=8, num_blocks=64), {"a": (prompt, params)})
    assert small["a"] == big["a"] and [len(t) for t, _ in small["a"]] == [4, 4]


def test_swapped_group_holding_most_of_the_pool_comes_back(model_dir, make_llm):
    """An n = 2 group swapped out with 7 of 8 blocks is swapped back in once the other request is
    done (it asked for 2 blocks more than it needs) and decodes what it would without the swap."""
    requests = {"b": ([5, 6, 7, 8], SamplingParams(max_tokens=12, **GREEDY)),
                "a": (list(range(10, 39)), SamplingParams(n=2, max_tokens=10, **GREEDY))}
    llm = make_llm(model_dir[0], block_size=8, num_blocks=8, enable_prefix_caching=False, swap_space_gib=0.001,
                   preemption_mode="swap")
    small = _run(llm, requests)
    assert llm.engine.scheduler.swap.num_swaps_out > 0
    big = _run(make_llm(model_dir[0], block_size=8, num_blocks=64), requests)
    assert small["a"] == big["a"] and small["b"] == big["b"]


@pytest.mark.parametrize("num_blocks", [8, 6])
def test_recomputed_group_shares_its_prompt_again(model_dir, make_llm, num_blocks):
    """An n = 2 group preempted by recompute is readmitted with its prompt's full blocks shared
    again (the first completion computes them, the second waits for it), so in 8 blocks it still
    decodes what it decodes unpreempted (it needed 10 blocks unshared, and hung). In 6 blocks it
    cannot fit even shared: it ends with "length", keeping its tokens, instead of waiting forever."""
    requests = {"b": ([5, 6, 7, 8], SamplingParams(max_tokens=30, **GREEDY)),
                "a": (list(range(10, 30)), SamplingParams(n=2, max_tokens=14, **GREEDY))}
    llm = make_llm(model_dir[0], block_size=8, num_blocks=num_blocks, enable_prefix_caching=False)
    done = _run(llm, requests)
    assert llm.engine.scheduler.num_preemptions > 0
    big = _run(make_llm(model_dir[0], block_size=8, num_blocks=64), requests)
    assert done["b"] == big["b"]
    if num_blocks == 8:
        assert done["a"] == big["a"]
    else:
        assert all(r == "length" and 0 < len(t) < 14 and t == big["a"][0][0][:len(t)] for t, r in done["a"])


def test_a_request_alone_beside_a_reservation_waits_for_its_blocks(model_dir, make_llm):
    """On a decode node a reservation holds blocks while its K/V arrive: a running request that
    then runs out of blocks is preempted and waits, not ended with "length" as if the pool were
    all its own; once the reservation is gone it completes."""
    llm = make_llm(model_dir[0], block_size=8, num_blocks=8, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(6):
        engine.step()
    assert engine.reserve("r", list(range(10, 50)), SamplingParams(max_tokens=1), 0) is not None
    for _ in range(40):
        engine.step()
        engine.check_integrity()
    assert [g.request_id for g in engine.scheduler.waiting] == ["a"]
    engine.abort_request("r")
    done = _run(llm, {})
    assert [(len(t), r) for t, r in done["a"]] == [(40, "length")]


def test_n_counts_against_max_num_seqs_before_the_group_forks(model_dir, make_llm):
    """max_num_seqs 4: an n = 3 request and two single ones never run more than 4 sequences at
    once, and an n above max_num_seqs is refused up front."""
    llm = make_llm(model_dir[0], max_num_seqs=4, num_blocks=64)
    done = _run(llm, {"n3": ([1, 2, 3], SamplingParams(n=3, max_tokens=6, **GREEDY)),
                      "x": ([4, 5], SamplingParams(max_tokens=6, **GREEDY)),
                      "y": ([6, 7], SamplingParams(max_tokens=6, **GREEDY))})
    assert done["most_seqs"] <= 4 and [len(t) for t, _ in done["n3"]] == [6, 6, 6]
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.engine.add_request("n5", [1, 2], SamplingParams(n=5))


def test_unchunked_prefill_bounds_the_context_by_the_step_budget(model_dir, make_llm):
    """Without chunked prefill a prompt (or a preempted sequence's recompute) is one step, so the
    context is at most max_num_batched_tokens: a longer prompt is refused, not left waiting."""
    llm = make_llm(model_dir[0], block_size=8, num_blocks=6, enable_chunked_prefill=False,
                   max_num_batched_tokens=16, enable_prefix_caching=False)
    assert llm.engine.max_model_len == 16
    with pytest.raises(ValueError, match="context"):
        llm.engine.add_request("long", list(range(10, 30)), SamplingParams())
    done = _run(llm, {"b": ([5, 6, 7, 8], SamplingParams(max_tokens=40, **GREEDY)),
                      "a": (list(range(40, 52)), SamplingParams(max_tokens=20, **GREEDY))})
    assert [(len(t), r) for t, r in done["a"]] == [(4, "length")]
    assert [(len(t), r) for t, r in done["b"]] == [(12, "length")]


def test_copy_on_write_planned_before_a_swap_out_is_read_from_its_source():
    """V (n = 2, sharing a partly filled last block) is scheduled and its copy-on-write planned;
    R, ahead of it, then needs blocks and V is swapped out in the same step. The swap-out must
    read the copy's source (the copy runs after swaps), and no copy may target V's freed blocks."""
    bs = 8
    bm = BlockManager(12, bs, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, SwapPool(32, bs, PreemptionMode.AUTO))

    def running(tokens: int, computed: int, blocks: int) -> Sequence:
        s = Sequence(list(range(3, 3 + tokens)), tokens, status=SequenceStatus.RUNNING)
        s.block_table = [bm.take_block() for _ in range(blocks)]
        s.num_computed_tokens = computed
        return s

    r = [running(17, 16, 2), running(17, 16, 2), running(17, 8, 3)]      # r[2] is still prefilling
    v0 = running(12, 11, 2)
    v1 = v0.fork(1)
    bm.fork(v0, v1)
    sched.running = [SequenceGroup("R", r, SamplingParams(n=3), 0.0, forked=True),
                     SequenceGroup("V", [v0, v1], SamplingParams(n=2), 1.0, forked=True)]
    while bm.num_free_blocks > 2:           # V's copy takes 1, R's growth needs 2
        bm.take_block()
    shared_last = v0.block_table[-1]
    out = sched.schedule()
    assert [g.request_id for g in sched.swapped] == ["V"]
    assert shared_last in {m.src for m in out.swap_out}                   # read from the source
    written = {c.dst for c in out.copies}
    assert not written & {m.src for m in out.swap_out}
    held = {b for g in sched.running for s in g.unfinished() for b in s.block_table}
    assert written <= held


def test_beam_group_too_big_for_the_pool_returns_its_beams_so_far(model_dir, make_llm):
    """Four beams outgrow a 6-block pool: the request ends with "length" and its best beams so
    far (it used to end with no completion at all)."""
    params = SamplingParams(beam_width=4, n=2, max_tokens=20, ignore_eos=True)
    done = _run(make_llm(model_dir[0], block_size=8, num_blocks=6, enable_prefix_caching=False),
                {"beams": (list(range(3, 20)), params)})
    assert len(done["beams"]) == 2
    assert all(r == "length" and 0 < len(t) < 20 for t, r in done["beams"])


@pytest.fixture(scope="module")
def vocab256(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama_v256")
    make_model(path, "llama", vocab=256)
    return str(path)


def test_beam_groups_readmitted_with_shared_blocks_decode_as_unpreempted(vocab256, make_llm):
    """Three beam requests and other traffic in 12 blocks, recomputed after preemption with
    their shared blocks computed once: every beam equals the same workload's in a roomy pool.
    (A beam that had waited for a lead dropped by beam search once waited forever, and the
    beams went out of step.)"""
    base = [226, 22, 130, 134, 211, 127, 119, 201, 11, 73, 196, 193]
    requests = {
        "x0": ([144, 121, 20, 213, 237, 239, 94, 203, 24, 117, 247, 74, 8, 40], SamplingParams(max_tokens=16, **GREEDY)),
        "x1": ([57, 149, 131, 175, 166, 160, 211, 181, 103, 57, 13, 32, 35, 162], SamplingParams(max_tokens=28, **GREEDY)),
        "x2": ([49, 82, 34, 91, 197, 198, 251, 185, 150, 137, 11, 15, 13, 120, 166, 137, 253],
               SamplingParams(max_tokens=11, **GREEDY)),
        "b0": (base + [50, 128, 244, 145, 122], SamplingParams(beam_width=2, n=2, max_tokens=10, length_penalty=0.5,
                                                                early_stopping="never")),
        "b1": (base + [91, 156, 91, 123, 231, 241, 212, 30], SamplingParams(beam_width=2, n=2, max_tokens=3,
                                                                              early_stopping="never")),
        "b2": (base + [12, 176, 52, 96], SamplingParams(beam_width=3, n=3, max_tokens=9, length_penalty=0.5,
                                                         early_stopping="never")),
    }
    llm = make_llm(vocab256, block_size=8, num_blocks=12, max_num_batched_tokens=64)
    tight = _run(llm, requests)
    assert llm.engine.scheduler.num_preemptions > 0
    roomy = _run(make_llm(vocab256, block_size=8, num_blocks=128, max_num_batched_tokens=64), requests)
    assert {k: tight[k] for k in requests} == {k: roomy[k] for k in requests}


def test_a_readmitted_group_swapped_before_its_shared_blocks_are_computed(model_dir, make_llm):
    """An n = 2 group recomputed and readmitted (its second completion waiting for the first to
    compute their shared blocks, in 4-token steps) is then swapped out: it must come back still
    waiting, or the second completion reads K/V nobody computed. Both equal transformers."""
    requests = {"B": ([5, 6, 7, 8], SamplingParams(max_tokens=70, **GREEDY)),
                "C": ([9, 10, 11, 12], SamplingParams(max_tokens=4, **GREEDY)),
                "A": (list(range(20, 37)), SamplingParams(n=2, max_tokens=30, **GREEDY))}
    llm = make_llm(model_dir[0], block_size=8, num_blocks=13, max_num_batched_tokens=4,
                   enable_prefix_caching=False, swap_space_gib=7 * 4096 / 2 ** 30, preemption_mode="swap")
    done = _run(llm, requests)
    assert llm.engine.scheduler.num_preemptions >= 2 and llm.engine.scheduler.swap.num_swaps_out >= 1
    expected = hf_greedy(model_dir[1], requests["A"][0], 30)
    assert [t for t, _ in done["A"]] == [expected, expected]


def test_a_failed_step_fails_even_the_groups_it_had_already_ended(model_dir, make_llm):
    """A step whose scheduler ended a group (too big for the pool) and then raised: fail_step
    reports that group too, so its caller can fail it, and its id is free again."""
    llm = make_llm(model_dir[0], block_size=8, num_blocks=6, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("a", list(range(10, 30)), SamplingParams(n=2, max_tokens=14, **GREEDY))
    schedule, execute, plans = engine.scheduler.schedule, engine.runner.execute, []

    def remember():
        plans.append(schedule())
        return plans[-1]

    def breaks_when_a_group_ended(scheduled):
        if plans[-1].finished:
            raise RuntimeError("injected")
        return execute(scheduled)
    engine.scheduler.schedule, engine.runner.execute = remember, breaks_when_a_group_ended
    with pytest.raises(RuntimeError, match="injected"):
        for i in range(300):
            if i == 30:     # something to run in the step that ends "a"
                engine.add_request("c", [40, 41, 42], SamplingParams(max_tokens=3, **GREEDY))
            engine.step()
    ended = [g.request_id for g in plans[-1].finished]
    assert ended and set(ended) <= set(engine.fail_step())
    assert not engine.has_unfinished_requests() and not engine._groups
    engine.scheduler.schedule, engine.runner.execute = schedule, execute
    assert _run(llm, {"a": ([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))})["a"][0][1] == "length"


def test_safe_step_fails_the_held_requests_and_a_third_failure_in_a_row_raises(model_dir, make_llm):
    """A step that raises fails the requests the engine held (not the ones arriving after); a
    working step resets the count; the third failure with no working step between re-raises."""
    from engine.llm_engine import MAX_STEP_FAILURES
    llm = make_llm(model_dir[0], num_blocks=32)
    engine, execute, broken = llm.engine, llm.engine.runner.execute, [True]

    def flaky(scheduled):
        if broken[0]:
            raise RuntimeError("device lost")
        return execute(scheduled)
    engine.runner.execute = flaky
    for i in range(MAX_STEP_FAILURES - 1):
        engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
        outputs, failed = engine.safe_step()
        assert outputs == [] and list(failed) == [f"r{i}"] and "device lost" in failed[f"r{i}"]
    broken[0] = False
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    assert engine.safe_step()[1] == {}                                  # works: the count starts over
    broken[0] = True
    for i in range(MAX_STEP_FAILURES):
        engine.add_request(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
        if i < MAX_STEP_FAILURES - 1:
            assert f"s{i}" in engine.safe_step()[1]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.safe_step()
    engine.runner.execute = execute
    engine.fail_step()
