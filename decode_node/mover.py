"""A decode node's side of a KV move: a running request leaves for another decode node with its
blocks, shipped over the transport prefill nodes use (node_shell/shipper.py, kvtransport).

    request here: prompt p, outputs o_1 .. o_n; K/V computed for p + o_1 .. o_{n-1} (o_n is
    sampled, its K/V not computed yet)

  1. PauseRequest(rid): the request stops between two steps; the blocks of its first
     L = len(p) + n - 1 tokens are pinned, the engine drops it, and the router hears
     Paused(rid, n, text before o_n) after every TokenDelta it was sent (n = 0: nothing held)
  2. the router reserves on D2 the prompt p + o_1 .. o_{n-1} (prior outputs n - 1), writer: this node
  3. ShipRequest(rid', rid, D2, xfer_id, D2's blocks): every block from D2's cached prefix on, the
     partial last one included, in BlockBatches, then Commit(first token o_n, L tokens): D2 adopts
     them as a prefill's and decodes on from o_n, exactly where this node stopped
  4. the pins go once the transport says the bytes left (exactly once: shipped, aborted, expired
     after lease_s unshipped, or the router's session lost)

Step 3 runs on the node's loop (at tp > 1 its blocks are gathered by a collective, which must not
race the engine's steps), so the whole ship has one deadline, MAX_LOOP_STALL_S from its start,
under the router's heartbeat timeout with room for the engine step that follows (see
MAX_LOOP_STALL_S), a heartbeat sent before each ship (decode_node/service.py). Each call is bounded: pairing by CONNECT_TIMEOUT_S, a send
into a peer whose queue is full by SEND_TIMEOUT_S (the sender's), the Abort after a failure by that
again. The blocks go in slices of one message (slice_blocks: this node's --kv-batch-mib, or the
receiving node's where it announced less at pairing: the sender packs to the smaller), and
before each slice and before the Commit the deadline must leave room for that send and an Abort:

    start    pairing      slice 1   slice 2  ...  no room left for a send + Abort: Abort, failed
      |--------|-----------|---------|--------|-------------|--- <= MAX_LOOP_STALL_S ---|

so a peer that drains slowly fails the move (retryably: the router re-prefills the request) well
before the router would take this node out; any failure on the way (TransportError, a RuntimeError
from the tp > 1 gather, a ValueError) fails the move, never the node. Over ZeroMQ a slice is one
message; the gather's own time is not reserved, only checked after it;
torch_dist's pairing also joins a process group within CONNECT_TIMEOUT_S (its TCPStore connect may
overrun that by a retry delay: kvtransport.torch_dist.MAX_JOIN_S), checked after it too. Why not
a slice per engine step instead, the loop serving between them: the ship would outlive
ShipRequest's handling (its failure reported from tick, a hold in flight across AbortRequest and
the lease), more state than the bound needs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from engine.block_manager import PinHandle
from engine.llm_engine import LLMEngine
from kvtransport.base import KVSender, TransportError
from node_shell.shipper import SEND_TIMEOUT_S, BlockShipper, Shipment
from pdwire.control import Paused, RequestFailed, ShipRequest
from pdwire.handshake import HandshakeError

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 3.0     # pairing with the receiving decode node, on this node's loop
# A whole ship's hold of the loop. The node cannot know the router's --heartbeat-timeout-s (default
# 10 s): a heartbeat goes out before each ship, and after the ship the loop runs an engine step before
# its next poll beats, so the router's timeout must exceed this plus the longest step; 7 s leaves 3 s
# of the default for that step.
MAX_LOOP_STALL_S = 7.0
assert MAX_LOOP_STALL_S >= CONNECT_TIMEOUT_S + 2 * SEND_TIMEOUT_S   # the longest pairing, a send, its Abort


class PastDeadline(RuntimeError):
    """The ship's next send could hold the loop past MAX_LOOP_STALL_S."""


@dataclass(slots=True)
class Held:
    """A paused request's blocks, pinned until shipped or released."""
    pin: PinHandle
    blocks: tuple[int, ...]     # the blocks of its first num_tokens tokens, in order
    num_tokens: int             # L: tokens whose K/V the blocks hold
    last_token: int             # o_n: the receiving node's first token
    expires_at: float


class KVMover:
    def __init__(self, engine: LLMEngine, make_sender: Callable[[], KVSender], lease_s: float,
                 slice_blocks: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        if slice_blocks < 1:
            raise ValueError(f"slice_blocks must be >= 1, got {slice_blocks}")
        self.engine, self.lease_s, self.clock = engine, lease_s, clock
        self.slice_blocks = slice_blocks        # blocks per send at most (one message of this node's batch)
        self._make_sender = make_sender
        self.sender: KVSender | None = None        # made at the first move
        self.shipper = BlockShipper()
        self.held: dict[str, Held] = {}

    def needs_poll(self) -> bool:
        """Whether shipped blocks stay pinned until their bytes have left (no socket says when)."""
        return bool(self.shipper.shipments)

    def waitables(self) -> list[zmq.Socket]:
        """The sender's sockets (replies of the receiving nodes), once a move made it."""
        return [] if self.sender is None else self.sender.waitables()

    def pause(self, rid: str, sent_tokens: int, before_last: int) -> Paused:
        """Step 1. sent_tokens / before_last: what the streamer sent of rid (tokens, and characters
        before the last token's, -1 if unknown). Drops rid from the engine in every case."""
        bs = self.engine.block_manager.block_size
        group = next((g for g in self.engine.scheduler.running if g.request_id == rid), None)
        seq = group.seqs[0] if group is not None and len(group.seqs) == 1 and group.beam is None else None
        n = seq.num_output_tokens if seq is not None and not seq.is_finished else 0
        movable = n > 0 and n == sent_tokens and before_last >= 0 and seq.num_computed_tokens == len(seq) - 1
        if movable:
            blocks = tuple(seq.block_table[:-(-seq.num_computed_tokens // bs)])
            self.held[rid] = Held(self.engine.block_manager.pin(list(blocks)), blocks, seq.num_computed_tokens,
                                  seq.token_ids[-1], self.clock() + self.lease_s)
        self.engine.abort_request(rid)
        return Paused(rid, n, before_last) if movable else Paused(rid, 0, 0)

    def ship(self, req: ShipRequest) -> RequestFailed | None:
        """Step 3; a RequestFailed (for the new attempt) if it cannot start. The held blocks are
        released once sent, or at once if nothing was sent."""
        held = self.held.pop(req.from_rid, None)
        if held is None:
            return RequestFailed(req.rid, f"nothing held for {req.from_rid}", True)
        if len(req.dst_block_ids) != len(held.blocks):
            self.engine.block_manager.unpin(held.pin)
            return RequestFailed(req.rid, f"{len(req.dst_block_ids)} blocks reserved for "
                                 f"{len(held.blocks)} held", True)
        shipment = Shipment(req.rid, req.xfer_id, tuple(req.dst_block_ids), held.num_tokens,
                            req.cached_prefix_blocks, pins=[held.pin])
        deadline = self.clock() + MAX_LOOP_STALL_S
        try:
            sender = self._sender()
            sender.connect(req.kv_endpoint, CONNECT_TIMEOUT_S)
            sender.begin(req.xfer_id, req.kv_endpoint)
        except (HandshakeError, TransportError, RuntimeError, ValueError) as err:
            self.engine.block_manager.unpin(held.pin)
            return RequestFailed(req.rid, f"cannot reach the decode node: {err}"[:500], True)
        self.shipper.track(shipment)
        try:
            n, step = len(shipment.dst_block_ids), self.peer_slice(sender, req.kv_endpoint)
            table = list(held.blocks)
            while shipment.next_index < n:
                self._room(deadline, shipment)
                self.shipper.ship(shipment, table, min(n, shipment.next_index + step))
            self._room(deadline, shipment)
            sender.commit(req.xfer_id, held.last_token, held.num_tokens)
        except (RuntimeError, ValueError) as err:       # TransportError, PastDeadline, the tp > 1 gather's
            log.warning("KV move %s of %s failed: %r", req.xfer_id, req.from_rid, err,
                        exc_info=not isinstance(err, (TransportError, PastDeadline)))
            _abort(sender, req.xfer_id)
            return RequestFailed(req.rid, f"KV move failed: {err}"[:500], True)
        finally:
            self.shipper.close(req.rid)
        return None

    def peer_slice(self, sender: KVSender, endpoint: str) -> int:
        """Blocks per send to the paired endpoint: slice_blocks, or fewer where the sender packs
        fewer blocks per message to it (the receiving node announced a smaller batch at pairing),
        so that each send is one message under one deadline check."""
        per = sender.blocks_per_message(endpoint)
        return self.slice_blocks if per is None else min(self.slice_blocks, per)

    def _room(self, deadline: float, s: Shipment) -> None:
        """Raise PastDeadline unless a send and an Abort, each up to SEND_TIMEOUT_S, fit before deadline."""
        if self.clock() + 2 * SEND_TIMEOUT_S > deadline:
            raise PastDeadline(f"blocks [0, {s.next_index}) of {len(s.dst_block_ids)} there when the next send "
                               f"could hold the loop past {MAX_LOOP_STALL_S:.0f} s")

    def release(self, rid: str) -> None:
        """Unpin rid's held blocks, if held (the router gave up the move)."""
        held = self.held.pop(rid, None)
        if held is not None:
            self.engine.block_manager.unpin(held.pin)

    def tick(self) -> None:
        """Free holds past their lease, and the pins of shipments whose bytes have left."""
        now = self.clock()
        for rid in [r for r, h in self.held.items() if h.expires_at <= now]:
            log.warning("held blocks of %s were not shipped within %.0f s: freed", rid, self.lease_s)
            self.release(rid)
        if self.sender is not None:
            self.sender.poll(0.0)       # heartbeats, replies; a committed transfer fails on D2's side
            self.shipper.release_sent()

    def drop_all(self) -> None:
        for rid in list(self.held):
            self.release(rid)

    def close(self) -> None:
        """Every hold and every shipment's pins released (the node is closing)."""
        self.drop_all()
        if self.sender is not None:
            self.sender.close()
            self.shipper.release_all()

    def _sender(self) -> KVSender:
        if self.sender is None:
            self.sender = self._make_sender()
            self.shipper.bind(self.engine, self.sender)
        return self.sender


def _abort(sender: KVSender, xfer_id: str) -> None:
    """Tells the receiving node the transfer is off; one that stopped draining may not take even
    that (the send times out): it fails the transfer itself, at its lease or the sender's silence."""
    try:
        sender.abort(xfer_id, "send failed")
    except TransportError as err:
        log.warning("KV move %s: the Abort could not be sent either: %s", xfer_id, err)
