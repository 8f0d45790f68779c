"""What rank 0 tells the workers, as two gloo broadcasts of int64 CPU tensors (no pickle), each
followed by the collectives it announces:

    header  [8]: op, T, S, M, R, N, max_seqlen_q, max_seqlen_k       (STEP)
                 op, G, 0, 0, 0, N, 0, 0                              (GATHER of G blocks)
    payload STEP   [3T + R + 3N + S*M + 2S + 1]: the ForwardBatch's tensors and the block ops:

      | input_ids T | positions T | slot_mapping T | logits_indices R | block ops 3N (kind|a|b) |
      | block_tables S*M | cu_seqlens_q S+1 | seq_lens S |

            GATHER [3N + G]:  | block ops 3N (kind|a|b) | block ids G |

    then    scatter  if K of the block ops are SCATTER: one scatter of the written blocks' head
                     slices, [K, num_layers, 2, block_size, num_kv_heads / tp, head_dim] per rank
            gather   GATHER: every rank's head slice of the G blocks, the same shape, to rank 0

    T tokens, S sequences, M blocks per table row, R sampled rows, N block ops.
The block ops are rank 0's runner calls since the last message (copy-on-write copies, swaps,
blocks written from another node), in call order; a worker replays them on its shard before it
runs the batch or gathers. SHUTDOWN is the header alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.forward_batch import ForwardBatch
from engine.parallel.group import TPGroup

HEADER_LEN = 8


class Op(IntEnum):
    STEP = 1        # replay the block ops, then run the batch
    SHUTDOWN = 2    # leave the loop and exit
    GATHER = 3      # replay the block ops, then send rank 0 this rank's heads of some blocks


class BlockOp(IntEnum):
    """A runner call on blocks, as (kind, a, b)."""
    COPY = 0          # copy_blocks: device block a -> device block b
    SWAP_OUT = 1      # swap_blocks: device block a -> host block b
    SWAP_IN = 2       # swap_blocks: host block a -> device block b
    ENABLE_SWAP = 3   # enable_swap: a host blocks
    SCATTER = 4       # write_blocks: scattered block b (this message's scatter) -> device block a


@dataclass(slots=True)
class StepMessage:
    op: Op
    batch: ForwardBatch | None          # CPU tensors; STEP only
    block_ops: torch.Tensor             # [3, N] int64: kind, a, b
    block_ids: torch.Tensor | None = None   # [G] int64: the blocks to gather; GATHER only

    @property
    def num_scattered(self) -> int:
        """K: the blocks this message's scatter carries."""
        return int((self.block_ops[0] == BlockOp.SCATTER).sum())


def send_shutdown(group: TPGroup) -> None:
    group.broadcast(torch.tensor([Op.SHUTDOWN] + [0] * (HEADER_LEN - 1), dtype=torch.long))


def send_step(group: TPGroup, batch: ForwardBatch, block_ops: torch.Tensor) -> None:
    """Rank 0: broadcast a CPU batch and the block ops [3, N] since the last message."""
    s, m = batch.block_tables.shape
    header = [Op.STEP, batch.num_tokens, s, m, batch.logits_indices.shape[0], block_ops.shape[1],
              batch.max_seqlen_q, batch.max_seqlen_k]
    group.broadcast(torch.tensor(header, dtype=torch.long))
    parts = [batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices,
             block_ops.reshape(-1), batch.block_tables.reshape(-1), batch.cu_seqlens_q, batch.seq_lens]
    group.broadcast(torch.cat([p.long() for p in parts]))


def send_gather(group: TPGroup, block_ids: torch.Tensor, block_ops: torch.Tensor) -> None:
    """Rank 0: ask for the workers' heads of blocks [G] (int64), after the block ops [3, N]."""
    n = block_ops.shape[1]
    group.broadcast(torch.tensor([Op.GATHER, block_ids.numel(), 0, 0, 0, n, 0, 0], dtype=torch.long))
    group.broadcast(torch.cat([block_ops.reshape(-1), block_ids]).long())


def send_scattered(group: TPGroup, blocks: torch.Tensor | None) -> None:
    """Rank 0, right after a message whose block ops hold K SCATTER ops: the written blocks
    [K, num_layers, 2, block_size, num_kv_heads, head_dim] (CPU), rank r getting its heads."""
    if blocks is not None:
        parts = blocks.chunk(group.world, dim=4)
        group.scatter(torch.empty_like(parts[0], memory_format=torch.contiguous_format), list(parts))


def receive_scattered(group: TPGroup, msg: StepMessage, shard: torch.Tensor) -> torch.Tensor | None:
    """A worker, right after receiving msg: its heads of the blocks msg's SCATTER ops write,
    [K, num_layers, 2, block_size, num_kv_heads / tp, head_dim] (CPU), shaped like shard's blocks."""
    if msg.num_scattered == 0:
        return None
    out = torch.empty((msg.num_scattered,) + tuple(shard.shape[1:]), dtype=shard.dtype)
    group.scatter(out)
    return out


def receive(group: TPGroup) -> StepMessage:
    """A worker: wait (indefinitely) for rank 0's next message."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    group.broadcast(header, idle=True)
    op, t, s, m, r, n, max_q, max_k = header.tolist()
    if Op(op) is Op.SHUTDOWN:
        return StepMessage(Op.SHUTDOWN, None, torch.empty((3, 0), dtype=torch.long))
    if Op(op) is Op.GATHER:
        payload = torch.empty(3 * n + t, dtype=torch.long)
        group.broadcast(payload)
        ops, ids = payload.split([3 * n, t])
        return StepMessage(Op.GATHER, None, ops.view(3, n), ids)
    payload = torch.empty(3 * t + r + 3 * n + s * m + 2 * s + 1, dtype=torch.long)
    group.broadcast(payload)
    ids, pos, slots, rows, ops, tables, cu, lens = payload.split([t, t, t, r, 3 * n, s * m, s + 1, s])
    batch = ForwardBatch(ids, pos, slots, tables.view(s, m).int(), cu.int(), lens.int(), rows, max_q, max_k)
    return StepMessage(Op.STEP, batch, ops.view(3, n))


def batch_to(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    if batch.input_ids.device == device:
        return batch
    move = lambda t: t.to(device, non_blocking=device.type == "cuda")    # noqa: E731  H2D only
    return ForwardBatch(move(batch.input_ids), move(batch.positions), move(batch.slot_mapping),
                        move(batch.block_tables), move(batch.cu_seqlens_q), move(batch.seq_lens),
                        move(batch.logits_indices), batch.max_seqlen_q, batch.max_seqlen_k)
