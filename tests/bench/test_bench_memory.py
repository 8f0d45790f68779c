"""The memory experiments (bench/memory_*.py) against small cases computed by hand."""
import pytest

from bench.memory_fragmentation import FirstFit, Req, classify, simulate_contiguous, simulate_paged
from bench.memory_sharing import share_one
from engine.block_manager import BlockManager


def test_classify_splits_held_slots():
    """Held slots = tokens now + slots the request will still fill + slots it never fills."""
    assert classify(cur=5, final=8, held=16) == (5, 3, 8)
    assert classify(cur=5, final=8, held=8) == (5, 3, 0)
    assert classify(cur=7, final=8, held=8) == (7, 1, 0)


def test_first_fit_merges_holes():
    """First fit takes the lowest hole; freeing neighbours merges them back into one."""
    space = FirstFit(32)
    assert [space.alloc(n) for n in (8, 8, 8)] == [0, 8, 16]
    space.free(8, 8)
    assert space.alloc(12) is None and space.unusable_for(12) == 16   # holes [8,16) and [24,32)
    space.free(0, 8)
    space.free(16, 8)
    assert space.holes == [(0, 32)]


REQS = [Req(5, 3), Req(2, 2), Req(4, 4)]


def test_contiguous_max_by_hand():
    """Max reservation (16 slots, 32-slot pool): A and B fill the pool for two steps while C
    waits: tokens 7 then 9, reserved-for-future 5 then 3, never-used 20 each step."""
    res = simulate_contiguous(REQS, pool_tokens=32, policy="max", max_len=16)
    f = res.figures(32)
    assert (res.steps, res.saturated_steps, res.preemptions) == (6, 2, 0)
    assert f["token_states"] == pytest.approx(16 / 2 / 32)
    assert f["reservation"] == pytest.approx(8 / 2 / 32)
    assert f["internal_frag"] == pytest.approx(40 / 2 / 32)
    assert f["external_frag"] == 0 and f["free"] == 0 and f["mean_running"] == 2
    assert f["tokens_per_held_slot"] == pytest.approx(16 / 64)


def test_paged_by_hand():
    """Paged, 3 blocks of 4: A holds 2 blocks, B 1, C waits two steps; nothing is wasted beyond
    the slots A and B will still fill (5 then 3)."""
    res = simulate_paged(REQS, pool_tokens=12, block_size=4, check_every=1)
    f = res.figures(12)
    assert (res.steps, res.saturated_steps, res.preemptions) == (6, 2, 0)
    assert f["token_states"] == pytest.approx(16 / 2 / 12)
    assert f["reservation"] == pytest.approx(8 / 2 / 12)
    assert f["internal_frag"] == 0 and f["free"] == 0
    assert f["tokens_per_held_slot"] == pytest.approx(16 / 24)


def test_paged_preempts_latest_and_finishes_everything():
    """Two blocks for two growing requests: B (admitted last) is preempted once, then both finish
    and every block is free again."""
    res = simulate_paged([Req(3, 3), Req(3, 3)], pool_tokens=8, block_size=4, check_every=1)
    assert res.preemptions == 1


def test_parallel_sampling_shares_prompt_blocks():
    """n = 2 over a 6-token prompt (blocks of 4): one copy-on-write of the shared partial block;
    physical blocks 2+2+2 against logical 4+2+2 over the three steps."""
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    assert share_one(bm, 6, [1, 3]) == (6, 8, 1)
    assert bm.num_free_blocks == 8
