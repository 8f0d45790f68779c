"""One message as a list of frames, sealed by the session of the connection it travels on.

    [header, trailer]   or   [header, payload, trailer]

header = the message's msgpack bytes; payload = the raw bytes of one block (BlockFrame only, zmq
and fake backends); trailer = the session's sequence number and MAC (kvtransport.session). The
sizes are checked first, then the MAC, and only then is the header parsed: a peer without the
session's keys cannot get a single byte interpreted.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from kvtransport.metrics import DropReason
from kvtransport.session import TRAILER_LEN, AuthError, Buffer, Session
from pdwire import control
from pdwire.messages import MAX_HEADER_BYTES, ProtocolError, decode, encode


class FrameError(Exception):
    """A received multipart message that must be dropped, and why."""

    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class Unpacked(NamedTuple):
    msg: Any
    payload: memoryview | None


class Framer:
    """Packs messages into sealed frames and unpacks (authenticates, then decodes) received ones.
    The codec defaults to the KV transport's messages; the control plane passes its own."""

    def __init__(self, max_payload_bytes: int = 1 << 30, max_header_bytes: int = MAX_HEADER_BYTES,
                 encoder: Callable[[Any], bytes] = encode,
                 decoder: Callable[[memoryview], Any] = decode) -> None:
        self.max_payload_bytes, self.max_header_bytes = max_payload_bytes, max_header_bytes
        self._encode, self._decode = encoder, decoder

    def pack(self, session: Session, msg: Any, payload: Buffer | None = None) -> list[Buffer]:
        header = self._encode(msg)
        if len(header) > self.max_header_bytes:
            raise ProtocolError(f"a {type(msg).__name__} of {len(header)} bytes is over the "
                                f"{self.max_header_bytes}-byte limit")
        trailer = session.seal(header, payload)
        return [header, trailer] if payload is None else [header, payload, trailer]

    def check_sizes(self, frames: Sequence[Buffer]) -> None:
        """Raises FrameError unless frames look like one sealed message within the size caps."""
        if not 2 <= len(frames) <= 3:
            raise FrameError(DropReason.MALFORMED, f"{len(frames)} frames")
        if len(frames[-1]) != TRAILER_LEN:
            raise FrameError(DropReason.BAD_MAC, "no trailer")
        if len(frames[0]) > self.max_header_bytes:
            raise FrameError(DropReason.OVERSIZE, f"header of {len(frames[0])} bytes")
        if len(frames) == 3 and len(frames[1]) > self.max_payload_bytes:
            raise FrameError(DropReason.OVERSIZE, f"payload of {len(frames[1])} bytes")

    def unpack(self, session: Session, frames: Sequence[Buffer]) -> Unpacked:
        """The message and payload in frames; raises FrameError with the drop reason."""
        self.check_sizes(frames)
        try:
            opened = session.open(frames)
        except AuthError as e:
            raise FrameError(e.reason, e.detail) from None
        return self.decode(opened)

    def decode(self, opened: Sequence[Buffer]) -> Unpacked:
        """The message in [header, payload?] that a session has already opened."""
        header = memoryview(opened[0])
        payload = memoryview(opened[1]) if len(opened) == 2 else None
        try:
            return Unpacked(self._decode(header), payload)
        except ProtocolError as e:
            raise FrameError(DropReason.MALFORMED, str(e)) from None


def control_framer() -> Framer:
    """Packs and unpacks sealed control messages (pdwire.control) of at most MAX_CONTROL_BYTES."""
    return Framer(max_payload_bytes=0, max_header_bytes=control.MAX_CONTROL_BYTES,
                  encoder=control.encode, decoder=control.decode)
