"""Ships a prompt's blocks to its decode node as soon as each one is computed.

Called by the engine after every step that computed part of a tracked prompt (a StepObserver):

    prompt of 37 tokens, block size 16, decode node already caches block 0:
      block:      0 (cached at D)   1 (full)       2 (partial: 5 tokens)
      shipped:    never             when computed  after the last chunk, before the first token

Sends are zero-copy from the pool: every shipped block is pinned (an extra reference) until the
transport says its bytes have left the process, so eviction cannot rewrite it mid-send.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    pins: list[Sequence] = field(default_factory=list)
    closed: bool = False                # committed or aborted: only pins remain to release


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
        if end <= s.next_index:
            return
        blocks = seq.block_table[s.next_index:end]
        s.pins.append(self.engine.pin_blocks(blocks))
        kv_cache = self.engine.runner.kv_cache
        for index, src in zip(range(s.next_index, end), blocks):
            self.sender.send_block(s.xfer_id, index, s.dst_block_ids[index], kv_cache, src)
        s.next_index = end

    def close(self, rid: str) -> Shipment | None:
        """The request is over here (committed or aborted); its pins go once sent."""
        s = self.shipments.get(rid)
        if s is not None:
            s.closed = True
        return s

    def release_sent(self) -> None:
        """Unpin the blocks of closed shipments whose bytes have all left the process."""
        for rid, s in list(self.shipments.items()):
            if s.closed and self.sender.is_sent(s.xfer_id):
                for holder in s.pins:
                    self.engine.unpin_blocks(holder)
                del self.shipments[rid]
