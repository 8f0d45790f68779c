"""The send side's bookkeeping: links to receivers, open transfers, heartbeats.

kvtransport.sender moves bytes over a link; this class decides what to send and when a
receiver counts as lost:

  link    one paired receiver (endpoint -> its session, identity, when it was last heard from);
          pairing is auth_hello() -> on_challenge() -> accept_ack() (kvtransport.session)
  open    xfer_id -> endpoint, from begin() until commit() / abort() / failure
  tick    every heartbeat_interval each link gets Heartbeat(epoch, open xfers on that link), in
          as many as it takes of MAX_HEARTBEAT_XFERS xfers each;
          a link silent for peer_timeout is lost and its open transfers fail (PEER_DEAD);
          a receiver answering with a new epoch, or no longer knowing us, restarted
          (PEER_RESTARTED); so did one that has no session for us (RESET); the node must
          connect() again
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvtransport.base import TransportError
from kvtransport.events import FailReason, TransferFailed
from kvtransport.framing import Framer, FrameError
from kvtransport.link import Dropped
from pdwire.handshake import PeerIdentity, check_compatible, dtype_name
from pdwire.messages import (MAX_HEARTBEAT_XFERS, WHOLE_BATCH_BYTES, Abort, BlockBatch, BlockFrame, Commit, Heartbeat,
                             Hello, HelloAck, LayerBatch, Message)
from kvtransport.metrics import DropReason, SenderMetrics
from kvtransport.session import AuthKind, Buffer, Initiator, Session, check_secret, parse_auth_frame

log = logging.getLogger("kvtransport")

_MAX_FAILED = 1 << 16    # failed xfer ids remembered so that late calls on them are no-ops


@dataclass(slots=True)
class _Link:
    session: Session
    remote: PeerIdentity
    last_seen: float
    next_heartbeat: float
    batch_bytes: int            # payload bytes of one BlockBatch the receiver takes (its HelloAck)
    layer_slices: bool          # the receiver takes LayerBatch (its HelloAck)
    sealed_first: bool          # the receiver reads [header, seal, payload*] (its HelloAck)
    split: bool                 # ... and [header, seal] then each payload alone (its HelloAck)
    announced_split: bool = False   # the receiver took split payloads (its HelloAck), whether or not we split
    beats: int = 0              # heartbeats due so far: where the next one starts naming its transfers


class SenderCore:
    """Bookkeeping of one KVSender. Not thread-safe."""

    def __init__(self, identity: PeerIdentity, secret: bytes, heartbeat_interval: float = 1.0,
                 peer_timeout: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 split_payloads: bool = True) -> None:
        """split_payloads: send payloads as messages of their own to receivers that take them."""
        self.identity = identity
        self._split = split_payloads
        self.framer = Framer()
        self._secret = check_secret(secret)
        self._handshakes: dict[str, Initiator | Session] = {}   # endpoint -> pairing under way
        self.metrics = SenderMetrics()
        self._interval, self._peer_timeout, self._clock = heartbeat_interval, peer_timeout, clock
        self._links: dict[str, _Link] = {}
        self._open: dict[str, str] = {}           # xfer_id -> endpoint
        self._failed: OrderedDict = OrderedDict()  # reported failed xfer ids (bounded)
        self._events: list[TransferFailed] = []

    def is_connected(self, endpoint: str) -> bool:
        return endpoint in self._links

    def auth_hello(self, endpoint: str) -> list[Buffer]:
        """Step 1 of pairing with endpoint: the handshake's hello."""
        initiator = self._handshakes[endpoint] = Initiator(self._secret)
        return [initiator.hello()]

    def on_challenge(self, endpoint: str, frames: Sequence[Buffer]) -> list[Buffer]:
        """Step 2: from endpoint's challenge, the session, and our sealed Hello to send on it."""
        auth, initiator = parse_auth_frame(frames), self._handshakes.pop(endpoint, None)
        if auth is None or auth[0] is not AuthKind.CHALLENGE or not isinstance(initiator, Initiator):
            raise TransportError(f"{endpoint} did not answer the handshake with a challenge")
        session = self._handshakes[endpoint] = initiator.on_challenge(auth[1])
        return self.framer.pack(session, Hello(self.identity))

    def accept_ack(self, endpoint: str, frames: Sequence[Buffer]) -> PeerIdentity:
        """Step 3: pair with endpoint from its reply to our Hello; raises HandshakeError /
        TransportError."""
        session = self._handshakes.pop(endpoint, None)
        if not isinstance(session, Session):
            raise TransportError(f"no handshake with {endpoint} under way")
        msg = self._unpack(session, endpoint, frames)
        if type(msg) is not HelloAck:
            raise TransportError(f"{endpoint} answered Hello with {type(msg).__name__}")
        if not msg.accepted:
            raise TransportError(f"{endpoint} refused pairing: {msg.reason}")
        check_compatible(self.identity, msg.identity)
        now = self._clock()
        self._links[endpoint] = _Link(session, msg.identity, now, now + self._interval, msg.max_batch_bytes,
                                      msg.layer_slices, msg.sealed_first,
                                      self._split and msg.sealed_first and msg.split_payloads,
                                      msg.sealed_first and msg.split_payloads)
        return msg.identity

    def forget(self, endpoint: str) -> None:
        """endpoint's pairing failed (after accept_ack too, e.g. its payload channel could not be
        set up): drop its handshake and link; no transfer is open on it."""
        self._handshakes.pop(endpoint, None)
        self._links.pop(endpoint, None)

    def batch_bytes(self, endpoint: str) -> int:
        """The payload bytes of one BlockBatch to the connected receiver at endpoint: what it
        announced, and WHOLE_BATCH_BYTES at most unless its payloads go as messages of their own.
        To a receiver that takes split payloads, a sender that does not split them (a decode node's
        KV mover) sends one block or slice a message: that receiver counts its queue in messages
        of one payload (ZeroMQ counts messages, not bytes), and drops a whole message of more."""
        link = self._links[endpoint]
        if link.split:
            return link.batch_bytes
        return 1 if link.announced_split else min(link.batch_bytes, WHOLE_BATCH_BYTES)

    def takes_layers(self, endpoint: str) -> bool:
        """Whether the connected receiver at endpoint takes LayerBatch."""
        return self._links[endpoint].layer_slices

    def splits(self, endpoint: str) -> bool:
        """Whether the connected receiver at endpoint takes a message's payloads as messages of
        their own: pack()'s [header, seal, *payloads] then leaves as [header, seal] and a
        message per payload, on the same connection, in order."""
        return self._links[endpoint].split

    def pack(self, endpoint: str, msg: Message, *payloads: Buffer) -> list[Buffer]:
        """msg (and its payload frames) sealed for the connected receiver at endpoint."""
        link = self._links[endpoint]
        return self.framer.pack_many(link.session, msg, payloads, link.sealed_first, link.split)

    def unpack(self, endpoint: str, frames: Sequence[Buffer]) -> Message:
        """A message from the connected receiver at endpoint; TransportError if it is bad, or if
        the link was lost meanwhile (e.g. silent for peer_timeout while its pairing went on)."""
        link = self._links.get(endpoint)
        if link is None:
            raise TransportError(f"{endpoint} was lost")
        return self._unpack(link.session, endpoint, frames)

    def begin(self, xfer_id: str, endpoint: str) -> None:
        if xfer_id in self._open or xfer_id in self._failed:
            raise ValueError(f"xfer {xfer_id} already begun")
        if endpoint not in self._links:
            raise TransportError(f"not connected to {endpoint}")
        self._open[xfer_id] = endpoint

    def is_open(self, xfer_id: str) -> bool:
        return xfer_id in self._open

    def endpoint_of(self, xfer_id: str) -> str | None:
        """The receiver of an open transfer; None if it failed; KeyError if never begun."""
        if xfer_id in self._failed:
            return None
        return self._open[xfer_id]

    def block_header(self, xfer_id: str, index: int, dst_block_id: int,
                     kv_cache: torch.Tensor) -> BlockFrame:
        """The header of a block of kv_cache; ValueError unless its blocks are this node's wire
        blocks (every kv head: a tensor-parallel node ships gathered copies, not its pool)."""
        return BlockFrame(xfer_id, index, dst_block_id, *self._wire_block(kv_cache))

    def batch_header(self, xfer_id: str, indices: list[int], dst_block_ids: list[int],
                     kv_cache: torch.Tensor) -> BlockBatch:
        """The header of blocks of kv_cache that travel in one message; ValueError as block_header."""
        return BlockBatch(xfer_id, tuple(indices), tuple(dst_block_ids), *self._wire_block(kv_cache))

    def layer_header(self, xfer_id: str, indices: list[int], dst_block_ids: list[int], kv_cache: torch.Tensor,
                     first_layer: int, num_layers: int) -> LayerBatch:
        """The header of layers [first_layer, first_layer + num_layers) of blocks of kv_cache that
        travel in one message; ValueError as block_header."""
        nbytes, dtype, shape = self._wire_block(kv_cache)
        return LayerBatch(xfer_id, tuple(indices), tuple(dst_block_ids), first_layer,
                          nbytes // shape[0] * num_layers, dtype, (num_layers, *shape[1:]))

    def _wire_block(self, kv_cache: torch.Tensor) -> tuple[int, str, tuple[int, ...]]:
        """(nbytes, dtype, shape) of one block of kv_cache, checked to be a wire block."""
        layout = self.identity.layout
        shape, dtype = tuple(kv_cache.shape[1:]), dtype_name(kv_cache.dtype)
        if (shape, dtype) != (layout.block_shape, layout.kv_dtype):
            raise ValueError(f"blocks ship as {layout.block_shape} {layout.kv_dtype} (every kv head), "
                             f"got {shape} {dtype}")
        return layout.block_nbytes, dtype, shape

    def commit_frames(self, xfer_id: str, first_token: int, num_tokens: int) -> list[Buffer]:
        frames = self.pack(self._open.pop(xfer_id), Commit(xfer_id, first_token, num_tokens))
        self.metrics.commits_sent += 1
        return frames

    def abort_frames(self, xfer_id: str, reason: str) -> list[Buffer]:
        frames = self.pack(self._open.pop(xfer_id), Abort(xfer_id, reason[:256]))
        self.metrics.aborts_sent += 1
        return frames

    def handle(self, endpoint: str, frames: Sequence[Buffer]) -> None:
        """One message from the receiver at endpoint; bad ones are counted (logged) and dropped."""
        link = self._links.get(endpoint)
        if link is None:
            return
        auth = parse_auth_frame(frames)
        if auth is not None and auth[0] is AuthKind.RESET:      # it no longer knows our session
            return self._lose(endpoint, FailReason.PEER_RESTARTED, "receiver has no session for us")
        try:
            msg = self._message(link.session, frames)
        except FrameError as e:
            return self.metrics.count_drop(e.reason, endpoint, e.detail)
        link.last_seen = self._clock()
        if type(msg) is Heartbeat and msg.epoch != link.remote.epoch:
            self._lose(endpoint, FailReason.PEER_RESTARTED, f"epoch {msg.epoch}")
        elif type(msg) is HelloAck and not msg.accepted:       # the receiver forgot us
            restarted = msg.identity.epoch != link.remote.epoch
            reason = FailReason.PEER_RESTARTED if restarted else FailReason.PEER_DEAD
            self._lose(endpoint, reason, msg.reason)
        elif type(msg) is Abort and self._open.get(msg.xfer_id) == endpoint:
            self._fail(msg.xfer_id, FailReason.PEER_ABORTED, msg.reason)

    def dropped(self, endpoint: str, drop: Dropped) -> None:
        """A message from endpoint that the link dropped unread (e.g. too many frames): counted."""
        self.metrics.count_drop(drop.reason, endpoint, drop.detail)

    def due_heartbeats(self) -> list[tuple[str, list[Buffer]]]:
        """(endpoint, frames) of each heartbeat due now (a link's open transfers named over as many
        as it takes, MAX_HEARTBEAT_XFERS each); also drops links silent too long."""
        now = self._clock()
        for endpoint in [e for e, l in self._links.items() if now - l.last_seen > self._peer_timeout]:
            self._lose(endpoint, FailReason.PEER_DEAD, f"silent for {self._peer_timeout}s")
        due = []
        for endpoint, link in self._links.items():
            if now >= link.next_heartbeat:
                link.next_heartbeat = now + self._interval
                xfers = tuple(x for x, e in self._open.items() if e == endpoint)
                if len(xfers) > MAX_HEARTBEAT_XFERS:    # each tick starts a chunk on: a full queue that takes
                    turn = link.beats * MAX_HEARTBEAT_XFERS % len(xfers)    # one message still names them all in turn
                    xfers = xfers[turn:] + xfers[:turn]
                link.beats += 1
                for k in range(0, max(1, len(xfers)), MAX_HEARTBEAT_XFERS):     # a header is small
                    beat = Heartbeat(self.identity.epoch, xfers[k:k + MAX_HEARTBEAT_XFERS])
                    due.append((endpoint, self.pack(endpoint, beat)))
        return due

    def take_events(self) -> list[TransferFailed]:
        events, self._events = self._events, []
        return events

    def lost(self, endpoint: str, reason: FailReason, detail: str) -> None:
        """The sender lost endpoint (e.g. its payload channel broke)."""
        self._lose(endpoint, reason, detail)

    def _lose(self, endpoint: str, reason: FailReason, detail: str) -> None:
        log.warning("receiver %s lost: %s %s", endpoint, reason.value, detail)
        self._links.pop(endpoint, None)
        for xfer_id in [x for x, e in self._open.items() if e == endpoint]:
            self._fail(xfer_id, reason, detail)

    def _fail(self, xfer_id: str, reason: FailReason, detail: str) -> None:
        del self._open[xfer_id]
        self._failed[xfer_id] = None
        if len(self._failed) > _MAX_FAILED:
            self._failed.popitem(last=False)
        self.metrics.transfers_failed += 1
        self._events.append(TransferFailed(xfer_id, reason, detail))

    def _unpack(self, session: Session, endpoint: str, frames: Sequence[Buffer]) -> Message:
        try:
            return self._message(session, frames)
        except FrameError as e:
            raise TransportError(f"bad message from {endpoint}: {e}") from None

    def _message(self, session: Session, frames: Sequence[Buffer]) -> Message:
        """The message sealed in frames; FrameError (why) if it is bad, or carries payloads."""
        msg, payloads = self.framer.unpack(session, frames)
        if payloads:
            raise FrameError(DropReason.MALFORMED, "unexpected payload")
        return msg

