"""The receive side shared by every backend: handshake, dispatch, peer liveness, replies.

The Receiver (kvtransport.receiver) turns its link into calls of `handle(peer, frames)` (one
multipart message from peer) and `tick()` (expire leases and dead peers), and supplies
`send(peer, frames)` for replies (HelloAck, Heartbeat, Abort) and a `PayloadSink` that moves a block's bytes into the pool.

  0. every connection first proves it holds the cluster secret (kvtransport.session); until
     then its messages are dropped unread (NOT_AUTHENTICATED, BAD_MAC) and it learns nothing
  1. Hello            -> check_compatible; HelloAck(accepted | refused, naming the field)
  2. any other message from a peer without an accepted Hello is dropped (NOT_PAIRED); a
     Heartbeat is answered with HelloAck(accepted=False) so a sender learns of a restart at once
  3. BlockFrame       -> ledger.check_block -> sink.write into the reserved block -> mark_written
     BlockBatch       -> ledger.check_batch (every block, or the batch is dropped whole) ->
                         sink.write_many (inline sinks only) -> mark_written
     LayerBatch       -> likewise, to sinks that take slices (a pool of every head, announced
                         in the HelloAck): write_many from the batch's first layer
     over a link that receives frame by frame (ZMQ), a paired peer's sealed-first block messages
     ([header, seal, payload*]) take landing(): ledger checks, then the seal's MAC -> the link
     receives each payload into its pool slot -> landed(): sizes as sealed, mark_written; any
     check that fails before the payloads makes it handle() (and every message in the older
     order [header, payload*, trailer] goes there); to a receiver built with split_payloads,
     a sender sends [header, seal] and then each payload as a message of its own: landing()
     as above claims the transfer and keeps the slots the peer owes (owed(), one batch a
     peer), the link receives each next message of that peer into the next slot, and landed()
     once all came, or once the peer sent anything but a bare payload (then short: dropped)
  4. Commit / Abort   -> ledger; Heartbeat -> renew leases of the transfers it names, reply naming those held
  5. tick: no message from a peer for peer_timeout -> its transfers fail (PEER_DEAD)
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvtransport.events import FailReason, TransferEvent
from kvtransport.framing import Framer, FrameError, Unpacked
from pdwire.handshake import HandshakeError, PeerIdentity, check_compatible
from pdwire.messages import (BATCH_BYTES, BATCH_BYTES_LIMIT, MAX_BATCH_BLOCKS, Abort, BlockBatch, BlockFrame, Commit,
                             Heartbeat, Hello, HelloAck, LayerBatch, Message, announced_batch_bytes)
from kvtransport.metrics import DropReason, ReceiverMetrics
from kvtransport.receiver_state import ReceiveLedger, Reservation
from kvtransport.session import AuthError, AuthKind, Buffer, Responder, declared_lengths, parse_auth_frame

log = logging.getLogger("kvtransport")

SendFn = Callable[[str, list[Buffer]], None]   # (peer, frames); must not block


class PayloadSink(ABC):
    """Moves one block's payload into the pool; the backends, and pools that hold only some of
    the heads (tensor parallelism, see payload.BlockWriterSink), differ only here."""
    inline: bool = True    # the payload is the BlockFrame's second frame (else it comes out of band)

    def paired(self, peer: str, identity: PeerIdentity, reply: Callable[[Message], None]) -> None:
        """peer completed the handshake (HelloAck sent); reply(msg) sends peer a message.

        Raises if the payload channel cannot be set up; the core then drops the peer."""

    def forget(self, peer: str) -> None:
        """peer is gone (dead, restarted or poisoned)."""

    @abstractmethod
    def write(self, peer: str, frame: BlockFrame, payload: memoryview | None, dst: int) -> None:
        """Write the block's bytes into pool block dst (already checked against the reservation).

        Raises if the payload channel failed; the core then drops the peer."""

    def slots(self, dsts: Sequence[int], first_layer: int, nbytes: int) -> list[memoryview] | None:
        """Writable views of nbytes of each pool block dsts[k] from layer first_layer on (checked),
        where a link may receive payloads straight into; None if the pool has no such bytes."""
        return None

    takes_layers: bool = False    # write_many takes layer slices (announced to senders in the HelloAck)
    has_slots: bool = False       # slots() gives views of the pool

    def write_many(self, dsts: list[int], payloads: list[memoryview], first_layer: int = 0) -> None:
        """Inline sinks: copy payloads[k] (checked: one wire block's bytes, or on a sink that takes
        layers its layers first_layer.. ) into pool block dsts[k]."""
        raise NotImplementedError(f"{type(self).__name__} takes no batch")

    def discard(self, peer: str, frame: BlockFrame, payload: memoryview | None) -> bool:
        """A checked-and-dropped block frame: consume its payload without writing the pool.

        Returns False if that is impossible and peer's payload channel is out of sync."""
        return True

    def unreadable(self, peer: str) -> bool:
        """A message from peer could not be read; True if that breaks peer's payload channel."""
        return False


@dataclass(slots=True)
class Landing:
    """A message whose payload frames go straight into pool slots (ReceiverCore.landing)."""
    msg: BlockFrame | BlockBatch | LayerBatch       # the header, authenticated by its seal and checked
    slots: list[memoryview]                         # where payload frame k goes: writable, its exact size
    declared: list[int]                             # the payload lengths the seal declares
    sizes: list[int] = field(default_factory=list)  # split: the sizes of the payload messages received so far
    seconds: float = 0.0                            # split: the time their copies took


@dataclass(slots=True)
class _Session:
    identity: PeerIdentity
    last_seen: float


class ReceiverCore:
    """Dispatches received messages of every peer into one ReceiveLedger."""
    sealed_first: bool = True   # announced in the HelloAck: senders put the seal before payloads

    def __init__(self, num_blocks: int, identity: PeerIdentity, secret: bytes,
                 sink: PayloadSink, send: SendFn, peer_timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_batch_bytes: int = BATCH_BYTES,
                 split_payloads: bool = False) -> None:
        """max_batch_bytes: the payload bytes of one BlockBatch this receiver takes (at least one
        block's; WHOLE_BATCH_BYTES at most unless it splits), announced to each sender in the HelloAck;
        split_payloads: announce that payloads may come as messages of their own (for a link that
        lands them, on a sink with slots)."""
        self.identity = identity
        self.ledger = ReceiveLedger(identity.layout, num_blocks, ReceiverMetrics(), clock)
        if not 1 <= max_batch_bytes <= BATCH_BYTES_LIMIT:
            raise ValueError(f"max_batch_bytes must be in [1, {BATCH_BYTES_LIMIT}], got {max_batch_bytes}")
        nbytes, self._split = identity.layout.block_nbytes, split_payloads and sink.has_slots
        max_batch_bytes = announced_batch_bytes(max_batch_bytes, self._split)
        # The announced bytes are the cap: a sender packs whole blocks or layer slices up to them,
        # and slices need not add up to a whole number of blocks (one block, at least, always fits).
        self._framer = Framer(max_payload_bytes=max(nbytes, min(max_batch_bytes, MAX_BATCH_BLOCKS * nbytes)))
        self._max_batch_bytes = max_batch_bytes
        self._auth = Responder(secret, clock=clock)
        self._sink, self._send = sink, send
        self._peer_timeout, self._clock = peer_timeout, clock
        self._sessions: dict[str, _Session] = {}
        self._unlanded: tuple[Buffer, Message] | None = None    # see landing(): (header, its message)
        self._owed: dict[str, Landing] = {}     # peer -> its split batch (at most MAX_SEALED_PAYLOADS slots)

    @property
    def metrics(self) -> ReceiverMetrics:
        return self.ledger.metrics

    def register(self, res: Reservation) -> None:
        self.ledger.register(res)

    def handle(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Process one received multipart message from peer; bad input is counted, never raised."""
        try:
            msg, payloads = self._open(peer, frames)
            if msg is not None:
                self._dispatch(peer, msg, payloads)
        except FrameError as e:
            self._dropped(peer, e)

    def landing(self, peer: str, header: Buffer, seal: Buffer, split: bool = False) -> Landing | None:
        """Where the payload frames after this header and seal may be received straight into (a
        link's one copy): the pool slots of its blocks, if peer holds a session and is paired,
        header decodes to a block frame or batch, every block passes the ledger's checks with
        the payload lengths the seal declares, the sink has the slots (a CPU pool of every head),
        and then the seal's MAC over the header and those lengths verifies (its sequence number
        is taken: the link must hand every payload to landed()). Else None, with nothing taken:
        the message is received whole and handled as any other (so is every message in the order
        before the seal). No byte lands before the MAC has been checked; slots are blocks the
        ledger still misses, reserved for a transfer that peer may touch. A header decoded here
        and not landed is not decoded again by the handle() of the same message, which comes next
        (a message in the older order whose first payload is shaped like a seal, for one).
        split: [header, seal] was the whole message (a split seal's): a landing claims the
        transfer for peer, and its slots are owed until landed()."""
        self._unlanded = None
        declared = declared_lengths(seal)
        if declared is None or len(header) > self._framer.max_header_bytes or peer not in self._sessions:
            return None
        if split and not self._split:
            return None             # not announced: handle() drops it (UNEXPECTED), its payloads follow
        try:
            msg = self._framer.decode_header(header)
        except FrameError:
            return None             # received whole, then counted with the reason it earns
        landing = self._land(peer, header, seal, msg, declared, split)
        self._unlanded = (header, msg) if landing is None else None
        if landing is not None and split:
            self.ledger.claim(peer, msg.xfer_id)    # no other connection lands it meanwhile
            self._owed[peer] = landing
        return landing

    def _land(self, peer: str, header: Buffer, seal: Buffer, msg: Message, declared: list[int],
              split: bool) -> Landing | None:
        """landing() once its header is decoded: the ledger's checks, the slots, the seal's MAC."""
        try:
            first = msg.first_layer if type(msg) is LayerBatch else 0
            if type(msg) is BlockFrame and len(declared) == 1:
                dsts = [self.ledger.check_block(peer, msg, declared[0])]
            elif type(msg) is BlockBatch or (type(msg) is LayerBatch and self._sink.takes_layers):
                self.ledger.check_batch(peer, msg, declared)
                dsts = msg.block_ids
            else:
                return None
        except FrameError:
            return None             # received whole, then counted with the reason it earns
        slots = self._sink.slots(dsts, first, msg.nbytes) if self._sink.inline else None
        if slots is None:
            return None
        try:
            self._auth.check_seal(peer, header, seal, split)
        except AuthError:
            return None             # likewise: a bad MAC or a replay is counted by handle()
        return Landing(msg, slots, declared)

    def owed(self, peer: str) -> Landing | None:
        """peer's split batch, if it still owes payload messages (landing.slots[len(landing.sizes)]
        is the next one's) and its transfer is still live and peer's; one whose transfer ended
        meanwhile (aborted, expired) is dropped and counted, and its payloads are then extras."""
        landing = self._owed.get(peer)
        if landing is None or self.ledger.holds(peer, landing.msg.xfer_id):
            return landing
        del self._owed[peer]
        self._dropped(peer, FrameError(DropReason.FINISHED_XFER, f"{landing.msg.xfer_id}: payloads still owed"))
        return None

    def owing(self) -> bool:
        return bool(self._owed)

    def landed(self, peer: str, landing: Landing, sizes: list[int], seconds: float) -> None:
        """The payload frames after landing's seal went into its slots (frame k: sizes[k] bytes,
        copied into slot k only if exactly its size; frames past the slots: sizes only), in seconds:
        if they are the sizes the seal declared (which the ledger checked), mark the blocks written.
        A split batch ends here too, owed no more: complete, or cut short by another message."""
        self._sessions[peer].last_seen = self._clock()      # paired: landing() saw it
        if self._owed.get(peer) is landing:
            del self._owed[peer]
        if sizes != landing.declared:
            return self._dropped(peer, FrameError(DropReason.BAD_NBYTES, f"{sizes} / sealed {landing.declared}"))
        self.ledger.mark_written(peer, landing.msg, seconds)

    def _dropped(self, peer: str, e: FrameError) -> None:
        self.metrics.count_drop(e.reason, peer, e.detail)
        if e.reason in (DropReason.BAD_MAC, DropReason.REPLAY, DropReason.MALFORMED, DropReason.OVERSIZE):
            self._maybe_poison(peer)

    def tick(self) -> None:
        """Fail the transfers of peers silent for peer_timeout, and those whose lease ran out."""
        now = self._clock()
        for peer in [p for p, s in self._sessions.items() if now - s.last_seen > self._peer_timeout]:
            self._drop_peer(peer, FailReason.PEER_DEAD, f"silent for {self._peer_timeout}s")
        for xfer_id, peer in self.ledger.expire():
            self._notify_abort(peer, xfer_id, "lease expired")

    def abort(self, xfer_id: str, detail: str = "") -> None:
        peer = self.ledger.abort(xfer_id, FailReason.LOCAL_ABORT, detail)
        self._notify_abort(peer, xfer_id, detail or "aborted by receiver")

    def close(self) -> None:
        for xfer_id in self.ledger.live_xfers():
            peer = self.ledger.abort(xfer_id, FailReason.CLOSED, "receiver closed")
            self._notify_abort(peer, xfer_id, "receiver closed")
        for peer in list(self._sessions):
            self._sink.forget(peer)
        self._sessions.clear()
        self._owed.clear()

    def take_events(self) -> list[TransferEvent]:
        return self.ledger.take_events()

    def _open(self, peer: str, frames: Sequence[Buffer]) -> Unpacked:
        """The sealed message in frames, or (None, None) for a handshake frame (answered here)."""
        auth = parse_auth_frame(frames)
        if auth is not None:
            if auth[0] is not AuthKind.HELLO:
                raise FrameError(DropReason.UNEXPECTED, f"auth {auth[0].name}")
            challenge = self._auth.challenge(peer, auth[1])
            if challenge is not None:
                self._send(peer, [challenge])
            return Unpacked(None, ())
        opened = self._authenticate(peer, frames)
        unlanded, self._unlanded = self._unlanded, None
        if unlanded is not None and unlanded[0] is opened[0]:    # decoded by landing(), now authenticated
            return self._framer.decode(opened, unlanded[1])
        return self._framer.decode(opened)

    def _authenticate(self, peer: str, frames: Sequence[Buffer]) -> list[Buffer]:
        """[header, *payloads] of the sealed message in frames, its sizes and MAC checked."""
        self._framer.check_sizes(frames)
        try:
            return self._auth.open(peer, frames, self._split)[1]
        except AuthError as e:
            if e.reason is DropReason.NOT_AUTHENTICATED and (reset := self._auth.refuse(peer)):
                self._send(peer, [reset])                   # e.g. this node restarted: start again
            raise FrameError(e.reason, e.detail) from None

    def _dispatch(self, peer: str, msg: Message, payloads: tuple[memoryview, ...]) -> None:
        if payloads and not (type(msg) in (BlockFrame, BlockBatch, LayerBatch) and self._sink.inline):
            raise FrameError(DropReason.MALFORMED, "unexpected payload frame")
        if type(msg) is Hello:
            return self._hello(peer, msg.identity)
        session = self._sessions.get(peer)
        if session is None:
            if type(msg) is Heartbeat:   # e.g. this node restarted: tell the sender at once
                self._reply(peer, HelloAck(self.identity, False, "not paired"))
            raise FrameError(DropReason.NOT_PAIRED, type(msg).__name__)
        session.last_seen = self._clock()
        if type(msg) is BlockFrame:
            self._block(peer, msg, payloads)
        elif type(msg) in (BlockBatch, LayerBatch):
            self._batch(peer, msg, payloads)
        elif type(msg) is Commit:
            self.ledger.on_commit(peer, msg)
        elif type(msg) is Abort:
            self.ledger.on_abort(peer, msg)
        elif type(msg) is Heartbeat:
            self.ledger.renew(peer, msg.open_xfers)
            held = tuple(x for x in msg.open_xfers if self.ledger.holds(peer, x))
            self._reply(peer, Heartbeat(self.identity.epoch, held))
        else:
            raise FrameError(DropReason.UNEXPECTED, type(msg).__name__)

    def _block(self, peer: str, frame: BlockFrame, payloads: tuple[memoryview, ...]) -> None:
        if self._sink.inline and len(payloads) != 1:
            raise FrameError(DropReason.MALFORMED, f"block frame with {len(payloads)} payloads")
        payload = payloads[0] if payloads else None
        try:
            dst = self.ledger.check_block(peer, frame, None if payload is None else len(payload))
        except FrameError:
            if not self._channel_ok(peer, lambda: self._sink.discard(peer, frame, payload)):
                self._drop_peer(peer, FailReason.CHANNEL_BROKEN, "undrainable payload")
            raise
        start = time.perf_counter()
        if self._channel_ok(peer, lambda: self._sink.write(peer, frame, payload, dst) or True):
            self.ledger.mark_written(peer, frame, time.perf_counter() - start)
        else:
            self._write_failed(peer, frame.xfer_id, "payload receive failed")

    def _batch(self, peer: str, batch: BlockBatch | LayerBatch, payloads: tuple[memoryview, ...]) -> None:
        sliced = type(batch) is LayerBatch
        if not (self._sink.takes_layers if sliced else self._sink.inline):
            raise FrameError(DropReason.MALFORMED, f"a {type(batch).__name__} on a sink that does not take it")
        self.ledger.check_batch(peer, batch, [len(p) for p in payloads])
        first = batch.first_layer if sliced else 0
        start = time.perf_counter()
        if self._channel_ok(peer, lambda: self._sink.write_many(list(batch.block_ids), list(payloads), first) or True):
            self.ledger.mark_written(peer, batch, time.perf_counter() - start)
        else:
            self._write_failed(peer, batch.xfer_id, "payload write failed")

    def _hello(self, peer: str, remote: PeerIdentity) -> None:
        try:
            check_compatible(self.identity, remote)
        except HandshakeError as e:
            log.warning("refused pairing with %s (%s): %s", peer, remote.node_id, e)
            return self._reply(peer, HelloAck(self.identity, False, str(e)))
        for other, s in list(self._sessions.items()):
            same_node = s.identity.node_id == remote.node_id
            if (other == peer or same_node) and s.identity.epoch != remote.epoch:
                self._drop_peer(other, FailReason.PEER_RESTARTED, f"new epoch {remote.epoch}")
        self._sessions[peer] = _Session(remote, self._clock())
        self.ledger.pair(peer, remote.node_id)
        self._reply(peer, HelloAck(self.identity, True, max_batch_bytes=self._max_batch_bytes,
                                   layer_slices=self._sink.takes_layers, sealed_first=self.sealed_first,
                                   split_payloads=self._split and self.sealed_first))
        reply = lambda msg: self._reply(peer, msg)  # noqa: E731
        if not self._channel_ok(peer, lambda: self._sink.paired(peer, remote, reply) or True):
            self._drop_peer(peer, FailReason.CHANNEL_BROKEN, "payload channel setup failed")

    def _write_failed(self, peer: str, xfer_id: str, detail: str) -> None:
        """The sink failed to write peer's payload of xfer_id (checked: peer may touch it): that
        transfer fails with the peer's others, even if this was its first write and peer has not
        claimed it yet (mark_written claims), which _drop_peer alone would leave to its lease."""
        self.ledger.abort(xfer_id, FailReason.CHANNEL_BROKEN, detail)
        self._drop_peer(peer, FailReason.CHANNEL_BROKEN, detail)

    def _drop_peer(self, peer: str, reason: FailReason, detail: str) -> None:
        log.warning("peer %s lost: %s %s", peer, reason.value, detail)
        self.ledger.fail_peer(peer, reason, detail)
        self.ledger.pair(peer, None)
        self._sessions.pop(peer, None)
        self._owed.pop(peer, None)
        self._auth.forget(peer)        # its session keys too: a connection's name is never reused
        self._sink.forget(peer)

    @staticmethod
    def _channel_ok(peer: str, op: Callable[[], bool]) -> bool:
        """Run a sink operation; False if it failed or raised (the channel is unusable)."""
        try:
            return bool(op())
        except Exception as e:   # gloo / NCCL raise RuntimeError subclasses of many kinds
            log.warning("payload channel of %s failed: %s", peer, e)
            return False

    def _maybe_poison(self, peer: str) -> None:
        if peer in self._sessions and self._sink.unreadable(peer):
            self._drop_peer(peer, FailReason.CHANNEL_BROKEN, "unreadable message on a p2p pair")

    def _notify_abort(self, peer: str | None, xfer_id: str, reason: str) -> None:
        if peer is not None and peer in self._sessions:
            self._reply(peer, Abort(xfer_id, reason[:256]))

    def _reply(self, peer: str, msg: Message) -> None:
        session = self._auth.session(peer)
        if session is not None:
            self._send(peer, self._framer.pack(session, msg))
