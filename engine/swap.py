"""Swap preemption: a preempted group's blocks move to a host swap pool and back, all or nothing.

Shared blocks stay shared: a block that k of the group's block tables hold becomes one swap
block with k references, and comes back as one device block with k references.

Which preemption to use is a policy object:
  recompute  free the blocks; the group prefills its prompt and output again
  swap       copy the blocks out (device -> swap pool), and back in before it runs again
  auto       swap groups of several sequences (n > 1, beams: recomputing them loses their
             sharing) and long sequences (>= swap_min_blocks blocks: recomputing costs more
             than two copies); recompute the rest
"""
from __future__ import annotations

import enum
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


class PreemptionMode(str, enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"


class BlockMove(NamedTuple):
    src: int   # block id in the pool copied from
    dst: int   # block id in the pool copied to


class SwapPool:
    def __init__(self, num_blocks: int, block_size: int, mode: PreemptionMode, swap_min_blocks: int = 32):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.mode = mode
        self.swap_min_blocks = swap_min_blocks
        self.num_swaps_out = 0

    def should_swap(self, group: SequenceGroup, device: BlockManager) -> bool:
        seqs = group.unfinished()
        blocks = len({b for s in seqs for b in s.block_table})
        if self.mode is PreemptionMode.RECOMPUTE or blocks > self.bm.num_free_blocks or not blocks:
            return False
        return self.mode is PreemptionMode.SWAP or len(seqs) > 1 or blocks >= self.swap_min_blocks

    def swap_out(self, group: SequenceGroup, device: BlockManager) -> list[BlockMove]:
        """Move every sequence of `group` into the swap pool; the caller copies the moves
        (device -> swap) before any freed device block is written again."""
        self.num_swaps_out += 1
        return _move(group.unfinished(), device, self.bm, SequenceStatus.SWAPPED)

    def can_swap_in(self, group: SequenceGroup, device: BlockManager, watermark: int) -> bool:
        """Whether the device has room for the group's blocks and what its next step appends."""
        seqs = group.unfinished()
        blocks = len({b for s in seqs for b in s.block_table})
        return blocks + self.bm.blocks_to_append_all(seqs) + watermark <= device.num_free_blocks

    def swap_in(self, group: SequenceGroup, device: BlockManager) -> list[BlockMove]:
        """Move `group` back to device blocks; the caller copies the moves (swap -> device)."""
        return _move(group.unfinished(), self.bm, device, SequenceStatus.RUNNING)


def _move(seqs: list[Sequence], src: BlockManager, dst: BlockManager,
          status: SequenceStatus) -> list[BlockMove]:
    mapping: dict[int, int] = {}
    tables = []
    for seq in seqs:
        table = []
        for block_id in seq.block_table:
            if block_id in mapping:
                dst.ref_block(mapping[block_id])
            else:
                mapping[block_id] = dst.take_block()
            table.append(mapping[block_id])
        tables.append(table)
    for seq, table in zip(seqs, tables):
        computed, writes_shared, waits_for = seq.num_computed_tokens, seq.writes_shared, seq.waits_for
        src.free(seq)
        seq.block_table, seq.num_computed_tokens, seq.status = table, computed, status
        seq.writes_shared, seq.waits_for = writes_shared, waits_for     # a readmitted group's sharing
    return [BlockMove(s, d) for s, d in mapping.items()]
