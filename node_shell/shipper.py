"""Ships a prompt's blocks to its decode node as soon as each one is computed (a prefill node), or
a paused request's blocks all at once (a decode node's KV move: decode_node/mover.py).

Called by the engine after every step that computed part of a tracked prompt (a StepObserver):

    prompt of 37 tokens, block size 16, decode node already caches block 0:
      block:      0 (cached at D)   1 (full)       2 (partial: 5 tokens)
      shipped:    never             when computed  after the last chunk, before the first token

A block ships with every kv head. At tp = 1 that is the pool's own block: sends are zero-copy,
and every shipped block is pinned (an extra reference) until the transport says its bytes have
left the process, so eviction cannot rewrite it mid-send. At tp > 1 each rank holds some heads:
the runner gathers them into a host copy (one collective per step and prompt), kept until sent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.block_manager import PinHandle
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence, SequenceGroup
from kvtransport.base import KVSender


@dataclass(slots=True)
class Shipment:
    rid: str
    xfer_id: str
    dst_block_ids: tuple[int, ...]      # D's whole block table for the prompt
    prompt_len: int
    next_index: int                     # first block not shipped yet (starts past D's cached prefix)
    pins: list[PinHandle] = field(default_factory=list)      # tp = 1: pool blocks held until sent
    staged: list[torch.Tensor] = field(default_factory=list)  # tp > 1: gathered copies held until sent
    closed: bool = False                # committed or aborted: only pins / staged copies remain


class BlockShipper:
    def __init__(self) -> None:
        self.engine: LLMEngine | None = None
        self.sender: KVSender | None = None
        self.shipments: dict[str, Shipment] = {}

    def bind(self, engine: LLMEngine, sender: KVSender) -> None:
        self.engine, self.sender = engine, sender

    def track(self, shipment: Shipment) -> None:
        self.shipments[shipment.rid] = shipment

    def on_computed(self, group: SequenceGroup, seq: Sequence) -> None:
        s = self.shipments.get(group.request_id)
        if s is None or s.closed:
            return
        bs = self.engine.block_manager.block_size
        done = seq.num_computed_tokens >= s.prompt_len
        end = len(s.dst_block_ids) if done else min(seq.num_computed_tokens // bs, len(s.dst_block_ids))
        self._send(s, seq.block_table, end)

    def ship(self, s: Shipment, blocks: list[int]) -> None:
        """Ship every block of s not sent yet now, from `blocks` (the source's table for s)."""
        self._send(s, blocks, len(s.dst_block_ids))

    def _send(self, s: Shipment, table: list[int], end: int) -> None:
        """Ship s's blocks [next_index, end) from the source blocks table[next_index:end]."""
        if end <= s.next_index:
            return
        kv_cache, sources = self._full_head_blocks(s, table[s.next_index:end])
        self.sender.send_blocks(s.xfer_id, list(range(s.next_index, end)), list(s.dst_block_ids[s.next_index:end]),
                                kv_cache, list(sources))
        s.next_index = end

    def _full_head_blocks(self, s: Shipment, blocks: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Where to send `blocks` from, with every kv head: (tensor [n, L, 2, bs, H, D], its ids)."""
        export = self.engine.runner.export_blocks(blocks)
        if export.aliases_pool:
            s.pins.append(self.engine.block_manager.pin(blocks))
        else:
            s.staged.append(export.kv_cache)
        return export.kv_cache, export.ids

    def close(self, rid: str) -> Shipment | None:
        """The request is over here (committed or aborted); its pins go once sent."""
        s = self.shipments.get(rid)
        if s is not None:
            s.closed = True
        return s

    def release_all(self) -> None:
        """The sender is closed: whatever it still had to send is dropped, every pin released."""
        for s in self.shipments.values():
            for handle in s.pins:
                self.engine.block_manager.unpin(handle)
        self.shipments.clear()

    def release_sent(self) -> None:
        """Unpin the blocks of closed shipments whose bytes have all left the process."""
        for rid, s in list(self.shipments.items()):
            if s.closed and self.sender.is_sent(s.xfer_id):
                for handle in s.pins:
                    self.engine.block_manager.unpin(handle)
                del self.shipments[rid]
