"""Turns a scheduled step into a ForwardBatch, runs the model over the paged pool, returns logits."""
from __future__ import annotations

import torch

import kernels
from engine.block_manager import BlockCopy
from engine.config import ModelConfig
from engine.direct_layers import DirectLayers
from engine.forward_batch import ForwardBatch
from engine.model import CausalLM
from engine.runner_base import BlockExport, RunnerBase, WriteBlocks
from engine.packed_linear import pack_linears
from engine.scheduler import ScheduledSeq
from engine.swap import BlockMove


class ModelRunner(RunnerBase):
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int):
        self.model = model
        pack_linears(model)             # CPU: oneDNN-packed weights (after any tp sharding)
        model.direct = DirectLayers.build(model)    # CPU, every linear packed: layers without module dispatch
        self.kv_cache = kv_cache        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.device = kv_cache.device
        self.swap_cache: torch.Tensor | None = None   # host pool shaped like kv_cache, if enabled

    def export_blocks(self, block_ids: list[int]) -> BlockExport:
        """The pool itself: sends read the blocks zero-copy, so they are pinned until sent."""
        return BlockExport(self.kv_cache, list(block_ids), aliases_pool=True)

    def block_writer(self) -> WriteBlocks | None:
        return None                     # every head is here: bytes go straight into the pool

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def enable_swap(self, num_blocks: int) -> None:
        """A host swap pool shaped like the device pool (pinned when the device is a GPU)."""
        shape = (num_blocks,) + tuple(self.kv_cache.shape[1:])
        self.swap_cache = torch.zeros(shape, dtype=self.kv_cache.dtype, pin_memory=self.device.type == "cuda")

    def swap_blocks(self, out: list[BlockMove], into: list[BlockMove]) -> None:
        """Copy swapped-out blocks to the swap pool, then swapped-in ones back (that order: a
        device block freed by a swap-out may be the destination of a swap-in)."""
        for moves, src, dst in ((out, self.kv_cache, self.swap_cache), (into, self.swap_cache, self.kv_cache)):
            if moves:   # only with a swap pool: only then are there moves
                s = torch.tensor([m.src for m in moves], dtype=torch.long, device=src.device)
                d = torch.tensor([m.dst for m in moves], dtype=torch.long, device=dst.device)
                dst[d] = src[s].to(dst.device, non_blocking=True)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if copies:
            src = torch.tensor([c.src for c in copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=self.device)
            kernels.copy_blocks(self.kv_cache, src, dst)

    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Logits (the model's dtype) for the scheduled sequences that sample, in order, then for
        every item's prompt_logprob_positions, in order: [R + P, vocab]."""
        batch = self.build_batch(scheduled)
        hidden = self.model(batch, self.kv_cache)
        return self.model.compute_logits(hidden)

    def build_batch(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        bs = self.block_size
        ids, positions, slots, cu, seq_lens, sample_rows, prompt_rows = [], [], [], [0], [], [], []
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = []                     # padded with 0, made a tensor once (not a copy per row)
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            ids += seq.token_ids[start:end]
            table = seq.block_table
            for p in range(start, end):
                slots.append(table[p // bs] * bs + p % bs)
            positions += range(start, end)
            cu.append(cu[-1] + item.num_new_tokens)
            seq_lens.append(end)
            tables.append(table + [0] * (max_blocks - len(table)))
            if item.samples:
                sample_rows.append(cu[-1] - 1)
            prompt_rows += (cu[-2] + p - start for p in item.prompt_logprob_positions)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=dev),
            max_seqlen_q=max(s.num_new_tokens for s in scheduled), max_seqlen_k=max(seq_lens),
        )
