"""Rank 0's log of the block ops its workers have not replayed yet (see runner.py, step_message.py).

Rank 0 makes every runner call on blocks (copy, swap, a write from another node) on its own
shard at once and logs it here; the log rides with the next message, and each worker replays it
in call order before it runs that message. A write (SCATTER) also keeps the written blocks: their
heads leave rank 0 as one scatter right after the message.

    ops      (COPY, 7, 9) (SCATTER, 12, 0) (SWAP_OUT, 3, 0) (SCATTER, 13, 1)
    written  [ block for 12 | block for 13 ]       SCATTER's b indexes the written blocks
"""
from __future__ import annotations

from typing import Iterable

import torch

from engine.parallel.step_message import BlockOp


class BlockLog:
    def __init__(self) -> None:
        self._ops: list[tuple[int, int, int]] = []    # (BlockOp, a, b), in call order
        self._written: list[torch.Tensor] = []        # each [n, L, 2, block_size, H, D], all heads, CPU
        self._num_written = 0

    def add(self, kind: BlockOp, pairs: Iterable[tuple[int, int]]) -> None:
        self._ops += [(kind, a, b) for a, b in pairs]

    def add_written(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Pool blocks `block_ids` now hold `blocks` [n, L, 2, block_size, H, D] (kept as a CPU copy)."""
        self._ops += [(BlockOp.SCATTER, b, self._num_written + i) for i, b in enumerate(block_ids)]
        self._written.append(blocks.to("cpu", copy=True))
        self._num_written += len(block_ids)

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ops [3, N] (kind, a, b) and the written blocks [K, ...] (None if none) since the
        last take; the log is empty after."""
        ops = torch.tensor(self._ops, dtype=torch.long).view(-1, 3).T
        written = torch.cat(self._written) if self._written else None
        self._ops, self._written, self._num_written = [], [], 0
        return ops, written
