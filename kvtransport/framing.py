"""One message as a list of frames, with an optional HMAC-SHA256 over all of them.

    no secret:    [header]            or  [header, payload]
    with secret:  [header, mac]       or  [header, payload, mac]

header = messages.encode(msg); payload = the raw bytes of one block (BlockFrame only, zmq and
fake backends); mac = HMAC-SHA256(secret, len(header) as 8 bytes || header || payload). The MAC
is checked before the header is parsed, so without the secret a peer cannot get a single byte
interpreted. With a secret the payload is authenticated too, which costs one SHA-256 pass over
every block (see bench/transfer_bench.py).
"""
from __future__ import annotations

import hashlib
import hmac
from typing import NamedTuple, Sequence

from kvtransport.messages import MAX_HEADER_BYTES, Message, ProtocolError, decode, encode
from kvtransport.metrics import DropReason

Buffer = bytes | memoryview
MAC_LEN = 32


class FrameError(Exception):
    """A received multipart message that must be dropped, and why."""

    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class Unpacked(NamedTuple):
    msg: Message
    payload: memoryview | None


class Framer:
    """Packs messages into frames and unpacks (and authenticates) received frames."""

    def __init__(self, secret: bytes | None = None, max_payload_bytes: int = 1 << 30) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("a shared secret must be at least 16 bytes")
        self._secret = secret
        self.max_payload_bytes = max_payload_bytes

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def pack(self, msg: Message, payload: Buffer | None = None) -> list[Buffer]:
        header = encode(msg)
        frames: list[Buffer] = [header] if payload is None else [header, payload]
        if self._secret is not None:
            frames.append(self._mac(header, payload))
        return frames

    def unpack(self, frames: Sequence[Buffer]) -> Unpacked:
        """The message and payload in frames; raises FrameError with the drop reason."""
        frames = [memoryview(f) for f in frames]
        if self._secret is not None:
            frames = self._verified(frames)
        if not 1 <= len(frames) <= 2:
            raise FrameError(DropReason.MALFORMED, f"{len(frames)} frames")
        header = frames[0]
        payload = frames[1] if len(frames) == 2 else None
        if len(header) > MAX_HEADER_BYTES:
            raise FrameError(DropReason.OVERSIZE, f"header of {len(header)} bytes")
        if payload is not None and len(payload) > self.max_payload_bytes:
            raise FrameError(DropReason.OVERSIZE, f"payload of {len(payload)} bytes")
        try:
            return Unpacked(decode(header), payload)
        except ProtocolError as e:
            raise FrameError(DropReason.MALFORMED, str(e)) from None

    def _verified(self, frames: list[memoryview]) -> list[memoryview]:
        if not 2 <= len(frames) <= 3 or len(frames[-1]) != MAC_LEN:
            raise FrameError(DropReason.BAD_MAC, "missing MAC")
        payload_len = len(frames[1]) if len(frames) == 3 else 0
        if len(frames[0]) > MAX_HEADER_BYTES or payload_len > self.max_payload_bytes:
            raise FrameError(DropReason.OVERSIZE, "frame above the cap")
        payload = frames[1] if len(frames) == 3 else None
        if not hmac.compare_digest(self._mac(frames[0], payload), frames[-1]):
            raise FrameError(DropReason.BAD_MAC, "wrong MAC")
        return frames[:-1]

    def _mac(self, header: Buffer, payload: Buffer | None) -> bytes:
        mac = hmac.new(self._secret, len(header).to_bytes(8, "little"), hashlib.sha256)
        mac.update(header)
        if payload is not None:
            mac.update(payload)
        return mac.digest()
