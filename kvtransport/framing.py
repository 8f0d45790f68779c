"""One message as a list of frames, sealed by the session of the connection it travels on.

    [header, trailer]   or   [header, seal, payload, ..., payload]
                        or   [header, seal] [payload] ... [payload]   (split: one message each)

header = the message's msgpack bytes; payload = the raw bytes of one block (BlockFrame: one
payload; BlockBatch: up to MAX_BATCH_BLOCKS), zmq and fake backends only; trailer = the
session's sequence number and MAC; seal = the trailer and the payloads' lengths, ahead of them
(kvtransport.session). To a receiver whose HelloAck does not announce the seal, payloads go
first: [header, payload, ..., payload, trailer]. The sizes are checked first, then the MAC, and
only then is the header parsed: a peer without the session's keys cannot get a single byte
interpreted. A link that receives frame by frame (ZMQ) reads a paired peer's header and seal
before its payloads: ReceiverCore.landing parses that header (the one exception to "MAC first",
for a peer that already holds a session; it changes no state, so a landing that fails uses no
sequence number), checks it against the ledger and then the seal's MAC, and only then names
pool slots to receive the payloads into (blocks the ledger still misses, reserved for a transfer
that peer may touch); ReceiverCore.landed compares the received sizes with the sealed ones
before it marks them written. Messages in the older order are received whole.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from kvtransport.metrics import DropReason
from kvtransport.session import TRAILER_LEN, AuthError, Buffer, Session, declared_lengths
from pdwire import control
from pdwire.messages import MAX_BATCH_BLOCKS, MAX_HEADER_BYTES, ProtocolError, decode, encode


class FrameError(Exception):
    """A received multipart message that must be dropped, and why."""

    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class Unpacked(NamedTuple):
    msg: Any
    payloads: tuple[memoryview, ...]       # the raw frames between header and trailer

    @property
    def payload(self) -> memoryview | None:
        """The one payload frame (BlockFrame), None if there is none."""
        return self.payloads[0] if len(self.payloads) == 1 else None


class Framer:
    """Packs messages into sealed frames and unpacks (authenticates, then decodes) received ones.
    The codec defaults to the KV transport's messages; the control plane passes its own.
    max_payload_bytes caps the payload frames of one message together."""

    def __init__(self, max_payload_bytes: int = 1 << 30, max_header_bytes: int = MAX_HEADER_BYTES,
                 encoder: Callable[[Any], bytes] = encode,
                 decoder: Callable[[memoryview], Any] = decode) -> None:
        self.max_payload_bytes, self.max_header_bytes = max_payload_bytes, max_header_bytes
        self._encode, self._decode = encoder, decoder

    def pack(self, session: Session, msg: Any, payload: Buffer | None = None) -> list[Buffer]:
        return self.pack_many(session, msg, () if payload is None else (payload,))

    def pack_many(self, session: Session, msg: Any, payloads: Sequence[Buffer],
                  sealed_first: bool = False, split: bool = False) -> list[Buffer]:
        """msg with any number of payload frames: [header, seal, *payloads] if sealed_first and
        there are payloads (split: a split seal's, for [header, seal] then each payload as a
        message of its own), else [header, *payloads, trailer]."""
        header = self._encode(msg)
        if len(header) > self.max_header_bytes:
            raise ProtocolError(f"a {type(msg).__name__} of {len(header)} bytes is over the "
                                f"{self.max_header_bytes}-byte limit")
        if sealed_first and payloads:
            return [header, session.seal_first(header, [len(p) for p in payloads], split), *payloads]
        return [header, *payloads, session.seal(header, *payloads)]

    def check_sizes(self, frames: Sequence[Buffer]) -> None:
        """Raises FrameError unless frames look like one sealed message within the size caps."""
        if not 2 <= len(frames) <= MAX_BATCH_BLOCKS + 2:
            raise FrameError(DropReason.MALFORMED, f"{len(frames)} frames")
        sealed = len(frames) >= 2 and declared_lengths(frames[1]) is not None   # 2: a split seal's
        if len(frames[-1]) != TRAILER_LEN and not sealed:
            raise FrameError(DropReason.BAD_MAC, "no trailer or seal")
        if len(frames[0]) > self.max_header_bytes:
            raise FrameError(DropReason.OVERSIZE, f"header of {len(frames[0])} bytes")
        if sum(len(f) for f in frames[1:]) - max(TRAILER_LEN, len(frames[1]) if sealed else 0) > \
                self.max_payload_bytes:     # either order: every frame but the header, trailer or seal
            raise FrameError(DropReason.OVERSIZE, f"frames of {[len(f) for f in frames[1:]]} bytes")

    def unpack(self, session: Session, frames: Sequence[Buffer]) -> Unpacked:
        """The message and payload in frames; raises FrameError with the drop reason."""
        self.check_sizes(frames)
        try:
            opened = session.open(frames)
        except AuthError as e:
            raise FrameError(e.reason, e.detail) from None
        return self.decode(opened)

    def decode(self, opened: Sequence[Buffer], msg: Any = None) -> Unpacked:
        """The message in [header, *payloads] that a session has already opened (msg: the header
        already decoded, by this framer, from these very bytes)."""
        payloads = tuple(memoryview(p) for p in opened[1:])
        if sum(len(p) for p in payloads) > self.max_payload_bytes:
            raise FrameError(DropReason.OVERSIZE, f"payloads of {[len(p) for p in payloads]} bytes")
        return Unpacked(self.decode_header(opened[0]) if msg is None else msg, payloads)

    def decode_header(self, header: Buffer) -> Any:
        """The message in a header frame that a session has opened, or whose seal a receiver is
        about to check (ReceiverCore.landing); raises FrameError (MALFORMED)."""
        try:
            return self._decode(memoryview(header))
        except ProtocolError as e:
            raise FrameError(DropReason.MALFORMED, str(e)) from None


def control_framer() -> Framer:
    """Packs and unpacks sealed control messages (pdwire.control) of at most MAX_CONTROL_BYTES."""
    return Framer(max_payload_bytes=0, max_header_bytes=control.MAX_CONTROL_BYTES,
                  encoder=control.encode, decoder=control.decode)
