"""Block manager: exact block ids, reference counts and free-queue order."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from pdwire.block_hash import chain_hashes, hash_block
from engine.block_manager import BlockCopy, BlockManager, IntegrityError, NoFreeBlocks
from engine.sequence import Sequence

BS = 4


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), len(tokens))


def finish_prefill(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = len(seq)
    bm.commit_computed(seq)


def test_allocate_takes_lowest_free_ids():
    """A new 10-token sequence gets blocks 0, 1, 2 and each is referenced once."""
    bm = BlockManager(8, BS)
    s = seq_of(range(10))
    assert bm.allocate(s) == 0
    assert s.block_table == [0, 1, 2]
    assert [b.ref_count for b in bm.blocks[:4]] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    bm.check_integrity([s])


def test_free_returns_blocks_tail_first():
    """Freed uncached blocks rejoin the free queue tail first."""
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    s = seq_of(range(10))
    bm.allocate(s)
    bm.free(s)
    assert list(bm._free) == [3, 2, 1, 0]
    t = seq_of(range(3))
    bm.allocate(t)
    assert t.block_table == [3]
    bm.check_integrity([t])


def test_append_slots_grows_by_one_block_at_boundary():
    """Decode appends a block only when the last one is full."""
    bm = BlockManager(8, BS)
    s = seq_of(range(4))
    bm.allocate(s)
    finish_prefill(bm, s)
    s.token_ids.append(99)
    assert bm.append_slots(s) == []
    assert s.block_table == [0, 1]
    s.token_ids.append(100)
    assert bm.append_slots(s) == [] and s.block_table == [0, 1]
    bm.check_integrity([s])


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    """A fork shares all blocks; the first write into the shared partial block copies it."""
    bm = BlockManager(8, BS)
    parent = seq_of(range(6))
    bm.allocate(parent)
    finish_prefill(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert [bm.blocks[b].ref_count for b in (0, 1)] == [2, 2]
    child.token_ids.append(7)
    assert bm.append_slots(child) == [BlockCopy(src=1, dst=2)]
    assert child.block_table == [0, 2]
    assert [bm.blocks[b].ref_count for b in (0, 1, 2)] == [2, 1, 1]
    parent.token_ids.append(8)
    assert bm.append_slots(parent) == []          # now the sole owner: writes in place
    bm.check_integrity([parent, child])


def test_prefix_hit_reuses_blocks_and_rechecks_tokens():
    """A second prompt with the same two leading blocks reuses them; tokens are re-checked."""
    bm = BlockManager(8, BS)
    a = seq_of(range(10))
    bm.allocate(a)
    finish_prefill(bm, a)
    b = seq_of(list(range(8)) + [50, 51, 52])
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] == 3
    assert bm.blocks[0].ref_count == 2
    # A forged cache entry whose tokens differ is not a hit.
    bm.blocks[0].token_ids = (9, 9, 9, 9)
    assert bm.match_prefix(list(range(8))) == []
    bm.blocks[0].token_ids = tuple(range(4))
    bm.check_integrity([a, b])
    assert bm.stats.hit_tokens == 8 and bm.stats.queried_tokens == 21


def test_fully_cached_prompt_still_computes_its_last_token():
    """A prompt that is entirely cached leaves its last block to be computed."""
    bm = BlockManager(8, BS)
    a = seq_of(range(8))
    bm.allocate(a)
    finish_prefill(bm, a)
    b = seq_of(range(8))
    assert bm.allocate(b) == 4
    assert b.block_table == [0, 2]
    bm.check_integrity([a, b])


def test_cached_blocks_survive_free_and_evict_lru_tail_first():
    """Freed hashed blocks stay cached; allocation takes free blocks first, then evicts the
    least recently freed cached block, tail blocks before head blocks."""
    bm = BlockManager(4, BS)
    a = seq_of(range(12))                      # three full blocks: 0, 1, 2
    bm.allocate(a)
    finish_prefill(bm, a)
    bm.free(a)
    assert list(bm._free) == [3] and list(bm._evictable) == [2, 1, 0]
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 4
    c = seq_of([100 + i for i in range(8)])    # needs two blocks: free 3, then evicts 2
    bm.allocate(c)
    assert c.block_table == [3, 2]
    assert bm.blocks[2].block_hash is None and list(bm._evictable) == [1, 0]
    d = seq_of(list(range(4)) + [7])           # hits head block 0, evicts block 1 for its tail
    assert bm.allocate(d) == 4
    assert d.block_table == [0, 1] and bm.blocks[1].block_hash is None and not bm._evictable
    bm.check_integrity([c, d])


def test_hits_on_cached_blocks_count_against_free_space():
    """Reviving a cached block takes it out of the free count."""
    bm = BlockManager(3, BS)
    a = seq_of(range(8))
    bm.allocate(a)
    finish_prefill(bm, a)
    bm.free(a)
    b = seq_of(list(range(4)) + [9] * 5)       # hits block 0, needs two more: 3 in all
    assert bm.can_allocate(b)
    assert not bm.can_allocate(b, reserve_tokens=4)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq_of([1]))
    bm.check_integrity([b])


def test_double_free_is_detected():
    """Dropping a reference below zero raises instead of corrupting the pool."""
    bm = BlockManager(2, BS)
    s = seq_of(range(3))
    bm.allocate(s)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(s)


def test_chained_hash_is_deterministic_and_position_sensitive():
    """The same block content hashes differently under a different prefix, identically across calls."""
    h1 = chain_hashes(list(range(8)), 4)
    assert h1 == chain_hashes(list(range(8)), 4) and len(h1[0]) == 16
    assert hash_block(None, [4, 5, 6, 7]) != h1[1]
    assert h1[0].hex() == hash_block(None, [0, 1, 2, 3]).hex()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free"]),
                          st.integers(0, 50), st.integers(1, 12)), max_size=40))
def test_random_operations_never_leak(ops):
    """Any sequence of allocate / append / fork / free keeps free + cached + in use == total
    and reference counts equal to block-table occurrences."""
    bm = BlockManager(12, BS)
    live: list[Sequence] = []
    for op, pick, n in ops:
        if op == "new":
            s = seq_of([pick % 3] * n)          # few distinct prompts: prefix hits happen
            if bm.can_allocate(s):
                bm.allocate(s)
                finish_prefill(bm, s)
                live.append(s)
        elif op == "grow" and live:
            s = live[pick % len(live)]
            s.token_ids.extend([pick] * (n % 5 + 1))
            if bm.can_append(s):
                bm.append_slots(s)
                finish_prefill(bm, s)
            else:
                del s.token_ids[s.num_computed_tokens:]
        elif op == "fork" and live:
            parent = live[pick % len(live)]
            child = parent.fork(1)
            bm.fork(parent, child)
            live.append(child)
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        bm.check_integrity(live)
    for s in live:
        bm.free(s)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks


def test_pin_holds_blocks_past_free_and_unpin_releases_tail_first():
    """A pin is one more reference per block: free keeps pinned blocks in use, unpin frees them tail first."""
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    s = seq_of(range(10))
    bm.allocate(s)
    handle = bm.pin([0, 1])
    assert [b.ref_count for b in bm.blocks] == [2, 2, 1, 0]
    assert bm.num_pins == 1
    bm.check_integrity([s])
    bm.free(s)
    assert [b.ref_count for b in bm.blocks] == [1, 1, 0, 0]
    assert list(bm._free) == [3, 2]
    bm.check_integrity([])
    bm.unpin(handle)
    assert [b.ref_count for b in bm.blocks] == [0, 0, 0, 0]
    assert list(bm._free) == [3, 2, 1, 0] and bm.num_pins == 0
    bm.check_integrity([])


def test_pinned_cached_block_is_not_evicted():
    """A pinned prefix block stays hashed and in use; after unpin it is cached (evictable), not free."""
    bm = BlockManager(2, BS)
    s = seq_of(range(8))
    bm.allocate(s)
    finish_prefill(bm, s)
    handle = bm.pin(list(s.block_table))
    bm.free(s)
    assert [b.ref_count for b in bm.blocks] == [1, 1] and bm.num_free_blocks == 0
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq_of(range(100, 104)))
    bm.unpin(handle)
    assert bm.num_cached_blocks == 2 and list(bm._evictable) == [1, 0]
    bm.check_integrity([])


def test_unpin_twice_raises():
    """An unknown or already released pin handle raises instead of dropping references twice."""
    bm = BlockManager(2, BS)
    s = seq_of(range(4))
    bm.allocate(s)
    handle = bm.pin([0])
    bm.unpin(handle)
    with pytest.raises(KeyError):
        bm.unpin(handle)
    assert [b.ref_count for b in bm.blocks] == [1, 0]
    bm.check_integrity([s])


def test_check_integrity_counts_pins():
    """check_integrity fails when a pinned block's count is not the tables' plus the pins' references."""
    bm = BlockManager(2, BS)
    s = seq_of(range(4))
    bm.allocate(s)
    bm.pin([0])
    bm.check_integrity([s])
    bm.blocks[0].ref_count = 1
    with pytest.raises(IntegrityError, match="reference counts"):
        bm.check_integrity([s])


def test_check_integrity_runs_under_python_O():
    """The check is not an assert: `python -O` (which drops asserts) still catches a leaked block."""
    leak = (
        "from engine.block_manager import BlockManager, IntegrityError\n"
        "bm = BlockManager(4, 16)\n"
        "bm.blocks[1].ref_count = 1\n"           # in use, yet held by no table: leaked
        "bm._free.remove(1)\n"
        "bm.check_integrity([])\n")
    out = subprocess.run([sys.executable, "-O", "-c", leak], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode != 0
    assert "IntegrityError: reference counts disagree with tables" in out.stderr
