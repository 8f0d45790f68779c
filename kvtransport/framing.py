"""One message as a list of frames, sealed by the session of the connection it travels on.

    [header, trailer]   or   [header, payload, ..., payload, trailer]

header = the message's msgpack bytes; payload = the raw bytes of one block (BlockFrame: one
payload; BlockBatch: up to MAX_BATCH_BLOCKS), zmq and fake backends only; trailer = the
session's sequence number and MAC (kvtransport.session). The sizes are checked first, then the
MAC, and only then is the header parsed: a peer without the session's keys cannot get a single
byte interpreted. One exception, for a peer that holds a session and is paired: the ZMQ link
decodes a block message's header before its trailer arrives, to receive the payload frames
straight into the pool blocks it names (ReceiverCore.landing); those must be blocks the ledger
still misses, reserved for a transfer that peer may touch, and none counts as written before
the MAC over the header and every frame's length has been checked (ReceiverCore.landed).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from kvtransport.metrics import DropReason
from kvtransport.session import TRAILER_LEN, AuthError, Buffer, Session
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

    def pack_many(self, session: Session, msg: Any, payloads: Sequence[Buffer]) -> list[Buffer]:
        """[header, *payloads, trailer]: msg with any number of payload frames."""
        header = self._encode(msg)
        if len(header) > self.max_header_bytes:
            raise ProtocolError(f"a {type(msg).__name__} of {len(header)} bytes is over the "
                                f"{self.max_header_bytes}-byte limit")
        return [header, *payloads, session.seal(header, *payloads)]

    def check_sizes(self, frames: Sequence[Buffer]) -> None:
        """Raises FrameError unless frames look like one sealed message within the size caps."""
        if not 2 <= len(frames) <= MAX_BATCH_BLOCKS + 2:
            raise FrameError(DropReason.MALFORMED, f"{len(frames)} frames")
        if len(frames[-1]) != TRAILER_LEN:
            raise FrameError(DropReason.BAD_MAC, "no trailer")
        if len(frames[0]) > self.max_header_bytes:
            raise FrameError(DropReason.OVERSIZE, f"header of {len(frames[0])} bytes")
        if sum(len(f) for f in frames[1:-1]) > self.max_payload_bytes:
            raise FrameError(DropReason.OVERSIZE, f"payloads of {[len(f) for f in frames[1:-1]]} bytes")

    def unpack(self, session: Session, frames: Sequence[Buffer]) -> Unpacked:
        """The message and payload in frames; raises FrameError with the drop reason."""
        self.check_sizes(frames)
        try:
            opened = session.open(frames)
        except AuthError as e:
            raise FrameError(e.reason, e.detail) from None
        return self.decode(opened)

    def decode(self, opened: Sequence[Buffer]) -> Unpacked:
        """The message in [header, *payloads] that a session has already opened."""
        payloads = tuple(memoryview(p) for p in opened[1:])
        try:
            return Unpacked(self._decode(memoryview(opened[0])), payloads)
        except ProtocolError as e:
            raise FrameError(DropReason.MALFORMED, str(e)) from None


def control_framer() -> Framer:
    """Packs and unpacks sealed control messages (pdwire.control) of at most MAX_CONTROL_BYTES."""
    return Framer(max_payload_bytes=0, max_header_bytes=control.MAX_CONTROL_BYTES,
                  encoder=control.encode, decoder=control.decode)
