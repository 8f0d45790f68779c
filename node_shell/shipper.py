"""Ships a prompt's blocks to its decode node as soon as each one is computed (a prefill node), or
a paused request's blocks all at once (a decode node's KV move: decode_node/mover.py).

Called by the engine after every step that computed part of a tracked prompt (a StepObserver):

    prompt of 37 tokens, block size 16, decode node already caches block 0:
      block:      0 (cached at D)   1 (full)       2 (partial: 5 tokens)
      shipped:    never             when computed  after the last chunk, before the first token

With layer_groups = G > 1 (a CPU pool at tp = 1, a receiver that takes layer slices; G above the
number of layers means one group per layer), the blocks that the last chunk completes, if at least
min_blocks, ship during its forward instead, in G layer groups: a hook at the end of each group's last decoder layer
ships that group's slices (its K/V of those blocks is final then), so only the last group's
slices are left to travel after the forward. A device pool keeps whole blocks: a host copy of
each group's slices would stall the forward.

    last chunk's forward:  layers 0-1 | layers 2-3 | ... | layers 6-7 | logits, first token, Commit
    shipped:                          0-1 slices   2-3 slices   ...    6-7 slices

A block ships with every kv head. At tp = 1 that is the pool's own block: sends are zero-copy,
and every shipped block is pinned (an extra reference) until the transport says its bytes have
left the process, so eviction cannot rewrite it mid-send. At tp > 1 each rank holds some heads:
the runner gathers them into a host copy (one collective per step and prompt), kept until sent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from engine.block_manager import PinHandle
from engine.llm_engine import LLMEngine
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceGroup
from kvtransport.base import KVSender, TransportError
from pdwire.control import TRANSFER_FAILED

# A send into a receiver whose queue is full (it stopped draining) holds the node's loop until the
# sender gives up, after this (a TransportError: that transfer fails). Every node that ships passes
# it to its sender: the router's heartbeat timeout (default 10 s) must exceed a stall by it plus
# the longest engine step (see decode_node/mover.py's MAX_LOOP_STALL_S for a KV move's sends).
SEND_TIMEOUT_S = 2.0


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


class _Sliced(NamedTuple):
    """A shipment whose remaining blocks this step's forward completes, shipped by layer group."""
    shipment: Shipment
    kv_cache: torch.Tensor      # the pool: [num_blocks, L, 2, bs, H, D]
    sources: list[int]          # its blocks for shipment's indices [next_index, len(dst_block_ids))


class BlockShipper:
    def __init__(self, layer_groups: int = 1, min_blocks: int = 1) -> None:
        if min_blocks < 1:          # 0 would slice a shipment with no block left to send
            raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
        self.engine: LLMEngine | None = None
        self.sender: KVSender | None = None
        self.shipments: dict[str, Shipment] = {}
        self.layer_groups = layer_groups           # > 1: the last chunk's blocks ship by layer group
        self.min_blocks = min_blocks               # ... if it completes at least this many (else whole after it)
        self._hooks: list = []                     # forward hooks at the groups' last layers (tp = 1)
        self._sliced: list[_Sliced] = []           # this step's
        self.failed: dict[str, str] = {}           # rid -> why a send failed inside a step (take_failed)

    def bind(self, engine: LLMEngine, sender: KVSender) -> None:
        self.engine, self.sender = engine, sender
        for hook in self._hooks:
            hook.remove()
        self._hooks, runner = [], engine.runner
        if self.layer_groups > 1 and runner.block_writer() is None and runner.kv_cache.device.type == "cpu":
            model = runner.model     # in this process, its pool holding every head (tp = 1)
            n, start = len(model.layers), 0
            for end in sorted({-(-g * n // self.layer_groups) for g in range(1, self.layer_groups + 1)}):
                self._hooks.append(model.layers[end - 1].register_forward_hook(partial(self._ship_layers, start, end)))
                start = end

    def track(self, shipment: Shipment) -> None:
        self.shipments[shipment.rid] = shipment

    def before_forward(self, scheduled: list[ScheduledSeq]) -> None:
        """Note the shipments whose remaining blocks this forward completes, if they go by layer group."""
        self._sliced = []
        for item in scheduled if self._hooks else ():
            s = self.shipments.get(item.group.request_id)
            last = s is not None and item.seq.num_computed_tokens + item.num_new_tokens >= s.prompt_len
            if last and not s.closed and len(s.dst_block_ids) - s.next_index >= self.min_blocks \
                    and self.sender.takes_layers(s.xfer_id):
                kv_cache, sources = self._full_head_blocks(s, item.seq.block_table[s.next_index:len(s.dst_block_ids)])
                self._sliced.append(_Sliced(s, kv_cache, sources))

    def _ship_layers(self, start: int, end: int, module, args, output) -> None:
        """A forward hook: layers [start, end) just returned; ship their slices of this step's blocks."""
        for s, kv_cache, sources in self._sliced:
            if s.rid in self.failed:
                continue
            n = len(s.dst_block_ids)
            try:
                self.sender.send_layers(s.xfer_id, list(range(s.next_index, n)), list(s.dst_block_ids[s.next_index:]),
                                        kv_cache, sources, start, end - start)
            except TransportError as err:       # this transfer only: the forward and the others go on
                self.failed[s.rid] = f"{TRANSFER_FAILED}: {err}"

    def on_computed(self, group: SequenceGroup, seq: Sequence) -> None:
        s = self.shipments.get(group.request_id)
        if s is None or s.closed or s.rid in self.failed:
            return
        if any(x.shipment is s for x in self._sliced):      # every layer group went during the forward
            s.next_index = len(s.dst_block_ids)
        bs = self.engine.block_manager.block_size
        done = seq.num_computed_tokens >= s.prompt_len
        end = len(s.dst_block_ids) if done else min(seq.num_computed_tokens // bs, len(s.dst_block_ids))
        try:
            self._send(s, seq.block_table, end)
        except TransportError as err:           # inside the engine's step: fail this request, not the step
            self.failed[s.rid] = f"{TRANSFER_FAILED}: {err}"

    def take_failed(self) -> dict[str, str]:
        """The requests whose sends failed during the last step, with why; the caller fails them."""
        failed, self.failed = self.failed, {}
        return failed

    def ship(self, s: Shipment, blocks: list[int], end: int | None = None) -> None:
        """Ship s's blocks not sent yet before `end` (default: all) now, from `blocks` (the source's table for s)."""
        self._send(s, blocks, len(s.dst_block_ids) if end is None else end)

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
