"""Preemption by swap and by recompute: the same tokens as never preempted; integrity holds
across the device pool and the swap pool."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.swap import PreemptionMode, SwapPool

PROMPTS = [[(i * 7 + j) % 400 + 5 for j in range(20)] for i in range(6)]


def _run(make_llm, path, **kwargs):
    llm = make_llm(path, block_size=8, enable_prefix_caching=False, **kwargs)
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    return llm, [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preempted_output_equals_unpreempted(model_dir, make_llm, mode):
    """n = 2 seeded sampling under a pool too small for the batch gives exactly the tokens of
    a pool large enough, whether groups are swapped out and in or recomputed."""
    path, _ = model_dir
    _, expected = _run(make_llm, path, num_blocks=256)
    llm, got = _run(make_llm, path, num_blocks=24, swap_space_gib=0.01, preemption_mode=mode)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert (sched.swap.num_swaps_out > 0) == (mode != "recompute")
    assert got == expected


def test_swap_keeps_sharing_and_conserves_both_pools():
    """A group whose two sequences share two blocks swaps out to two shared swap blocks (ref 2)
    plus their private ones, and back; both pools conserve their blocks."""
    device, pool = BlockManager(8, 4), SwapPool(8, 4, PreemptionMode.SWAP)
    a = Sequence(list(range(10)), 10)
    device.allocate(a)
    a.num_computed_tokens = 10
    b = a.fork(1)
    device.fork(a, b)
    b.token_ids.append(99)
    device.append_slots(b)                          # CoW of the partial third block
    group = SequenceGroup("g", [a, b], None, 0.0)
    moves = pool.swap_out(group, device)
    assert len(moves) == 4 and a.status is SequenceStatus.SWAPPED
    assert [pool.bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    device.check_integrity([])
    pool.bm.check_integrity([a, b])
    assert device.num_free_blocks == 8 and a.num_computed_tokens == 10
    back = pool.swap_in(group, device)
    assert len(back) == 4 and a.block_table[:2] == b.block_table[:2]
    device.check_integrity([a, b])
    pool.bm.check_integrity([])
