"""Authenticated sessions on the node network: nothing a peer sends is read before it proves
that it holds the cluster secret, and every message after that carries a MAC and a sequence number.

    initiator I (a DEALER: node -> router, prefill -> decode)     responder R (a ROUTER)
    1. [MAGIC "h" nonce_i]                              ──▶  remembers nonce_i for this connection
    2.                                                  ◀──  [MAGIC "c" nonce_r]
    3. both derive a key per direction from (secret, nonce_i, nonce_r); every later message,
       both ways, is  [header, trailer]  or, with payload frames,  [header, seal, payload+]  with
         trailer = seq (8 bytes) || HMAC-SHA256(key, seq || len(header) || lengths || header)
         seal    = seq || HMAC-SHA256(key, "S" || count || seq || len(header) || lengths || header) || lengths
                   (count = how many lengths: no seal verifies as a trailer or under another count)
       where lengths = len(p) of each payload frame p (8 bytes each; one 0 when there is none).
       The seal comes before the payloads, so a receiver checks the MAC over the header and the
       lengths the sender declares before it writes a payload byte anywhere, then only compares
       the sizes it received with them. A receiver announces that it reads the seal (HelloAck
       sealed_first); to one that does not, payload frames go first: [header, payload+, trailer]
       (the order before the seal), which a receiver takes too, whole, by its trailer. To one
       that announces split_payloads, [header, seal] goes as one message and then each payload
       as a message of its own, on the same connection, in order (its MAC under SPLIT_FORM, so
       no seal of one form verifies as the other's: kvtransport.receiver_core keeps the slots
       a peer still owes).
       R takes I's first sealed message (Hello / NodeHello) as the proof: until it verifies,
       nothing I sent is decoded, and a peer without the secret learns nothing but a random nonce.
    4. each sequence number is accepted once: a replayed message is dropped, and so is one that
       comes REPLAY_WINDOW or more numbers behind the newest (the IPsec anti-replay window).
    R answers a sealed message on a connection it has no session for with [MAGIC "r"]: the peer
    (e.g. across R's restart) starts again at 1.

The MAC covers the header, which names the transfer, blocks, byte counts, dtype and shape, and
every payload frame's length, not its bytes: the payloads are frames of one ZeroMQ multipart message,
delivered whole or not at all on the one connection whose session authenticated its header (the
ZMQ receivers name a peer by its connection, kvtransport.zmtp_auth.connection_name, not by the
routing id it chose, so no other connection can use that session), and no unprivileged local
process can write into that TCP connection. Hashing every block would cost more
than the transfer (HMAC-SHA256 runs at ~1.3 GB/s here, the wire at 2.5-6); see
bench/transfer_bench.py and the README for links that cross an untrusted network.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import struct
import time
from collections import OrderedDict
from enum import Enum
from typing import Callable, Sequence

from kvtransport.metrics import DropReason
from pdwire.messages import MAX_BATCH_BLOCKS

Buffer = bytes | memoryview

MAGIC = b"PDA1"
NONCE_LEN = 16
SEQ_LEN = 8
TAG_LEN = 32
TRAILER_LEN = SEQ_LEN + TAG_LEN
MIN_SECRET_LEN = 16
REPLAY_WINDOW = 64
SEAL_FORM = b"S"           # MAC'd ahead of a seal's fields: a seal and a trailer never share a tag
SPLIT_FORM = b"D"          # likewise, a seal whose payloads follow as messages of their own
MAX_SEALED_PAYLOADS = MAX_BATCH_BLOCKS   # payload frames one seal declares (a BlockBatch's most blocks)
_SHA256_BLOCK = 64         # bytes: HMAC pads its key to this
_IPAD = bytes(x ^ 0x36 for x in range(256))     # RFC 2104's inner and outer pads, as translate tables
_OPAD = bytes(x ^ 0x5C for x in range(256))


class AuthKind(Enum):
    HELLO = b"h"        # I -> R, with I's nonce
    CHALLENGE = b"c"    # R -> I, with R's nonce
    RESET = b"r"        # R -> I: no session here for that connection; start again


class AuthError(Exception):
    """A message that fails authentication; `reason` is the drop reason to count."""

    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@functools.lru_cache(maxsize=2 * MAX_SEALED_PAYLOADS)
def _u64s(n: int) -> struct.Struct:
    """n little-endian unsigned 64-bit integers."""
    return struct.Struct(f"<{n}Q")


def declared_lengths(seal: Buffer) -> list[int] | None:
    """The payload lengths a seal declares, or None if seal is not shaped as one (a trailer, or
    the first payload frame of a message in the order before the seal)."""
    count, rest = divmod(len(seal) - TRAILER_LEN, SEQ_LEN)
    if rest or not 1 <= count <= MAX_SEALED_PAYLOADS:
        return None
    return list(_u64s(count).unpack_from(seal, TRAILER_LEN))


def auth_frame(kind: AuthKind, nonce: bytes = b"") -> bytes:
    return MAGIC + kind.value + nonce


def parse_auth_frame(frames: Sequence[Buffer]) -> tuple[AuthKind, bytes] | None:
    """(kind, nonce) if frames is one handshake frame, else None (a sealed message, or garbage)."""
    if len(frames) != 1 or bytes(frames[0][:len(MAGIC)]) != MAGIC:
        return None
    body = bytes(frames[0][len(MAGIC):])
    kind = next((k for k in AuthKind if body[:1] == k.value), None)
    want = 1 if kind is AuthKind.RESET else 1 + NONCE_LEN
    return (kind, body[1:]) if kind is not None and len(body) == want else None


def check_secret(secret: bytes) -> bytes:
    if type(secret) is not bytes or len(secret) < MIN_SECRET_LEN:
        raise ValueError(f"the cluster secret must be at least {MIN_SECRET_LEN} bytes")
    return secret


class MacKey:
    """HMAC-SHA256 under one key (RFC 2104, as hmac computes it), the two padded key blocks hashed
    once: each message's MAC starts from copies of those two states. hmac.digest hashes both again
    for every message, and an hmac.HMAC copy costs more (OpenSSL copies three contexts); cold
    (a block copy just evicted the caches, as on the receive path) this is ~1.5-2x cheaper."""
    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > _SHA256_BLOCK:
            raise ValueError(f"a MacKey takes at most {_SHA256_BLOCK} bytes (session keys are 32)")
        block = key.ljust(_SHA256_BLOCK, b"\0")
        self._inner = hashlib.sha256(block.translate(_IPAD))
        self._outer = hashlib.sha256(block.translate(_OPAD))

    def digest(self, *parts: Buffer) -> bytes:
        """HMAC-SHA256(key, the concatenation of parts)."""
        inner = self._inner.copy()
        for part in parts:
            inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class Session:
    """The keys and sequence numbers of one authenticated connection, from one end. Not thread-safe."""

    def __init__(self, secret: bytes, nonce_i: bytes, nonce_r: bytes, initiator: bool) -> None:
        salt = nonce_i + nonce_r
        keys = {d: hmac.new(secret, b"pdserve-session-v1 " + d + salt, hashlib.sha256).digest()
                for d in (b"i2r", b"r2i")}
        send, recv = (keys[b"i2r"], keys[b"r2i"]) if initiator else (keys[b"r2i"], keys[b"i2r"])
        self._send_mac, self._recv_mac = MacKey(send), MacKey(recv)
        self._send_seq = 0
        self._recv_seq = -1                  # the highest sequence number accepted so far
        self._recv_seen = 0                  # bit k: _recv_seq - k was accepted (k < REPLAY_WINDOW)

    def seal(self, header: Buffer, *payloads: Buffer) -> bytes:
        """The trailer that authenticates [header, *payloads] as this end's next message."""
        seq = self._send_seq.to_bytes(SEQ_LEN, "little")
        self._send_seq += 1
        return seq + self._tag(self._send_mac, seq, header, [len(p) for p in payloads])

    def seal_first(self, header: Buffer, lengths: Sequence[int], split: bool = False) -> bytes:
        """The seal of [header, seal, *payloads] (payloads of these lengths, 1 to
        MAX_SEALED_PAYLOADS of them) as this end's next message; split: of [header, seal], each
        payload then a message of its own."""
        if not 1 <= len(lengths) <= MAX_SEALED_PAYLOADS:
            raise ValueError(f"a seal declares 1..{MAX_SEALED_PAYLOADS} payloads, not {len(lengths)}")
        seq = self._send_seq.to_bytes(SEQ_LEN, "little")
        self._send_seq += 1
        packed = _u64s(len(lengths)).pack(*lengths)
        return seq + self._seal_tag(self._send_mac, seq, header, packed, SPLIT_FORM if split else SEAL_FORM) + packed

    def open_seal(self, header: Buffer, seal: Buffer, split: bool = False) -> list[int]:
        """The payload lengths that seal declares for the message of this header (split: for the
        payload messages that follow it), before any payload is read; raises AuthError if it is
        no seal, or its MAC (of that form) or sequence is wrong."""
        lengths = declared_lengths(seal)
        if lengths is None:
            raise AuthError(DropReason.BAD_MAC, "no seal")
        self.check_seal(header, seal, split)
        return lengths

    def check_seal(self, header: Buffer, seal: Buffer, split: bool = False) -> None:
        """open_seal without unpacking the lengths (a receiver that has them, from declared_lengths):
        the MAC is taken over the seal's own bytes (seq, packed lengths) as they came (the receive
        path's per-batch call, run with cold caches)."""
        count, rest = divmod(len(seal) - TRAILER_LEN, SEQ_LEN)
        if rest or not 1 <= count <= MAX_SEALED_PAYLOADS:
            raise AuthError(DropReason.BAD_MAC, "no seal")
        self._check(self._seal_tag(self._recv_mac, seal[:SEQ_LEN], header, seal[TRAILER_LEN:],
                                   SPLIT_FORM if split else SEAL_FORM), seal)

    def open(self, frames: Sequence[Buffer], split: bool = False) -> list[Buffer]:
        """[header, *payloads] of a sealed message, in either order ([header] of a split seal's
        [header, seal], whose payloads come apart, if this end took the split: else UNEXPECTED);
        raises AuthError if its MAC or sequence is wrong, or (BAD_NBYTES) if its payloads are not
        those its seal declares."""
        if len(frames) == 2 and declared_lengths(frames[1]) is not None:
            if not split:
                raise AuthError(DropReason.UNEXPECTED, "a split seal, and split payloads were not announced")
            self.open_seal(frames[0], frames[1], split=True)
            return [frames[0]]
        if len(frames) >= 3 and declared_lengths(frames[1]) is not None:
            try:
                lengths = self.open_seal(frames[0], frames[1])
            except AuthError as e:
                if e.reason is not DropReason.BAD_MAC:
                    raise           # else: a payload frame shaped like a seal, in the older order
            else:
                if lengths != [len(p) for p in frames[2:]]:
                    raise AuthError(DropReason.BAD_NBYTES, f"payloads of {[len(p) for p in frames[2:]]} "
                                                           f"bytes, sealed as {lengths}")
                return [frames[0], *frames[2:]]
        if len(frames) < 2 or len(frames[-1]) != TRAILER_LEN:
            raise AuthError(DropReason.BAD_MAC, "no trailer")
        trailer = frames[-1]
        self._check(self._tag(self._recv_mac, bytes(trailer[:SEQ_LEN]), frames[0],
                              [len(p) for p in frames[1:-1]]), trailer)
        return list(frames[:-1])

    def _check(self, tag: bytes, sealed: Buffer) -> None:
        """Accept the sequence number of sealed (a trailer or a seal) if it carries tag."""
        if not hmac.compare_digest(tag, sealed[SEQ_LEN:TRAILER_LEN]):
            raise AuthError(DropReason.BAD_MAC, "wrong MAC")
        self._accept(int.from_bytes(sealed[:SEQ_LEN], "little"))

    def _accept(self, seq: int) -> None:
        behind = self._recv_seq - seq
        if behind >= REPLAY_WINDOW or (behind >= 0 and self._recv_seen >> behind & 1):
            raise AuthError(DropReason.REPLAY, f"sequence {seq} with {self._recv_seq} seen")
        if behind < 0:
            kept = self._recv_seen << -behind if -behind < REPLAY_WINDOW else 0   # a jump: all out
            self._recv_seen = (kept | 1) & ((1 << REPLAY_WINDOW) - 1)
            self._recv_seq = seq
        else:
            self._recv_seen |= 1 << behind

    @staticmethod
    def _tag(mac: MacKey, seq: bytes, header: Buffer, lengths: Sequence[int]) -> bytes:
        """A trailer's MAC: over seq, the sizes (header's, then each payload's, or one 0) and the
        header."""
        sizes = _u64s(len(lengths) + 1).pack(len(header), *lengths) if lengths else _u64s(2).pack(len(header), 0)
        return mac.digest(seq + sizes, header)

    @staticmethod
    def _seal_tag(mac: MacKey, seq: Buffer, header: Buffer, packed: Buffer, form: bytes) -> bytes:
        """A seal's MAC: over its form and payload count, then as a trailer's (seq, the header's
        size, the payloads' sizes as the seal packs them) and the header; so no seal verifies as a
        trailer, under another form or under another count."""
        return mac.digest(b"".join((form, (len(packed) // SEQ_LEN).to_bytes(SEQ_LEN, "little"), seq,
                                    len(header).to_bytes(SEQ_LEN, "little"), packed)), header)


class Initiator:
    """The connecting end's handshake: hello(), then on_challenge() gives the session."""

    def __init__(self, secret: bytes) -> None:
        self._secret = check_secret(secret)
        self._nonce = b""

    def hello(self) -> bytes:
        """The first frame of a new handshake (a fresh nonce each time)."""
        self._nonce = secrets.token_bytes(NONCE_LEN)
        return auth_frame(AuthKind.HELLO, self._nonce)

    def on_challenge(self, nonce_r: bytes) -> Session:
        if not self._nonce:
            raise AuthError(DropReason.UNEXPECTED, "challenge without a hello")
        session, self._nonce = Session(self._secret, self._nonce, nonce_r, initiator=True), b""
        return session


class Responder:
    """The listening end's handshakes and sessions, per connection (peer). Handshakes not yet
    proven are bounded in number and age, so a flood of hellos holds a fixed amount of memory.
    Sessions are bounded too: past max_sessions the least recently used one is forgotten (its
    peer, if it comes back, is answered RESET and opens a new one), so connections that a peer
    abandoned without a goodbye (a node reconnecting after a removal) do not pile up."""

    def __init__(self, secret: bytes, max_pending: int = 1024, pending_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_sessions: int = 4096) -> None:
        self._secret = check_secret(secret)
        self._max_pending, self._ttl, self._clock = max_pending, pending_ttl_s, clock
        self._max_sessions = max_sessions
        self._pending: OrderedDict[str, tuple[float, Session]] = OrderedDict()
        self._sessions: OrderedDict[str, Session] = OrderedDict()   # least recently used first
        self._refused: OrderedDict[str, None] = OrderedDict()   # peers sent a RESET (bounded)

    def challenge(self, peer: str, nonce_i: bytes) -> bytes | None:
        """Answer peer's hello: its session waits for its first sealed message. None (no answer)
        while peer's earlier handshake is pending: an initiator says hello once per connection,
        so a flood of hellos on one connection costs one challenge."""
        held = self._pending.get(peer)
        if held is not None and self._clock() - held[0] <= self._ttl:
            return None
        nonce_r = secrets.token_bytes(NONCE_LEN)
        self._pending.pop(peer, None)
        self._pending[peer] = (self._clock(), Session(self._secret, nonce_i, nonce_r, initiator=False))
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
        return auth_frame(AuthKind.CHALLENGE, nonce_r)

    def open(self, peer: str, frames: Sequence[Buffer], split: bool = False) -> tuple[Session, list[Buffer]]:
        """The peer's session and [header, payload?] of its sealed message (split: a split seal's
        is taken, Session.open). A message that verifies under the peer's pending handshake
        establishes (or replaces) its session. Raises AuthError: NOT_AUTHENTICATED if peer has no
        session, BAD_MAC, REPLAY or UNEXPECTED."""
        pending = self._pending.pop(peer, None)
        if pending is not None and self._clock() - pending[0] <= self._ttl:
            try:
                opened = pending[1].open(frames, split)
            except AuthError:
                self._pending[peer] = pending       # a stray message does not end the handshake
                if peer not in self._sessions:
                    raise
            else:
                self._sessions.pop(peer, None)
                self._sessions[peer] = pending[1]
                while len(self._sessions) > self._max_sessions:
                    self._sessions.popitem(last=False)
                self._refused.pop(peer, None)
                return pending[1], opened
        session = self._sessions.get(peer)
        if session is None:
            raise AuthError(DropReason.NOT_AUTHENTICATED, "no session")
        opened = session.open(frames, split)
        self._sessions.move_to_end(peer)
        return session, opened

    def refuse(self, peer: str) -> bytes | None:
        """The RESET that answers a sealed message from peer, which has no session; None if peer
        was sent one already and has not opened a session since (a flood is answered once)."""
        if peer in self._refused:
            return None
        self._refused[peer] = None
        while len(self._refused) > self._max_pending:
            self._refused.popitem(last=False)
        return auth_frame(AuthKind.RESET)

    def check_seal(self, peer: str, header: Buffer, seal: Buffer, split: bool = False) -> None:
        """Session.check_seal of peer's seal (shaped as one: declared_lengths is not None), under
        its established session only; raises AuthError (NOT_AUTHENTICATED while a new handshake of
        peer's is pending: its message must be received whole and opened by open())."""
        session = self._sessions.get(peer)
        if session is None or peer in self._pending:
            raise AuthError(DropReason.NOT_AUTHENTICATED, "no established session")
        session.check_seal(header, seal, split)
        self._sessions.move_to_end(peer)

    def session(self, peer: str) -> Session | None:
        return self._sessions.get(peer)

    def forget(self, peer: str) -> None:
        self._sessions.pop(peer, None)
        self._pending.pop(peer, None)
        self._refused.pop(peer, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)
