"""What nodes ask of a model runner besides stepping: blocks out for shipping, blocks in from a
peer, and close. ModelRunner (tp = 1) and TPModelRunner (tp > 1) implement it, so node code never
asks which one it holds."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

import torch

# (pool block ids, blocks [n, num_layers, 2, block_size, num_kv_heads, head_dim] with every head)
WriteBlocks = Callable[[list[int], torch.Tensor], None]


class BlockExport(NamedTuple):
    """Where to send some pool blocks from, with every kv head."""
    kv_cache: torch.Tensor      # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
    ids: list[int]              # rows of kv_cache to send, in the order asked
    aliases_pool: bool          # True: the rows ARE the live pool blocks (pin them until sent);
                                # False: a private copy (keep it alive until sent)


class RunnerBroken(RuntimeError):
    """The runner can run no more steps: a tensor-parallel worker exited, or a collective failed
    or timed out (a rank that stopped answering), leaving the ranks out of step. The engine is
    done: its process ends (a node says goodbye, and the router moves its requests)."""


class RunnerBase(ABC):
    kv_cache: torch.Tensor      # [num_blocks, num_layers, 2, block_size, num_kv_heads / tp, head_dim]

    @abstractmethod
    def export_blocks(self, block_ids: list[int]) -> BlockExport:
        """Pool blocks `block_ids` ready to ship. Mutates nothing; at tp > 1 a collective."""

    @abstractmethod
    def block_writer(self) -> WriteBlocks | None:
        """The sink for blocks received from a peer: None if a wire block's bytes go straight
        into kv_cache[block_id] (the pool holds every head), else a function that must copy
        the blocks it is given before returning."""

    def close(self) -> None:
        """Release what the runner holds besides memory (worker processes); idempotent."""
