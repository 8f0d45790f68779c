"""The ZMQ link: one ROUTER on the receive side (a DEALER per decode node on the send side).

Send side: kvtransport.zmq_send_link.

Receive side: peers are told apart by their connection (zmtp_auth.connection_name: the routing id
and the User-Id the ZAP handler gave the connection, so a connection that reuses a closed one's
routing id is a new peer, with no session); frames arrive as [routing id, header,
seal, payload*] (or [routing id, header, payload*, trailer] from a sender before the seal), or,
to a receiver that announced split payloads, [routing id, header, seal] and then [routing id,
payload] a message per payload: libzmq hands over a multipart message only once its last frame
is in, so each payload of a split batch is copied while it is still warm, as it lands. A
payload is copied once, from libzmq's buffer into its pool block: each frame is received
zero-copy (a pyzmq Frame, which tells its size and whether more frames follow without a
getsockopt: ~3.7 us a call in pyzmq) and copied with streaming stores (kvtransport/stream_copy.py:
the slot is cold, and a memcpy would first read each of its lines), and only if it is exactly its
slot's size, when the Lander (ReceiverCore.landing) names its slot from the header and the seal,
whose MAC it has checked (each frame's buffer is freed as soon as it is copied, so the next
frames libzmq allocates reuse warm memory, which a ZmqReceiver's kvtransport.heap keeps mapped);
else the message is received whole with copy=False and the sink copies it. libzmq
disconnects a peer that sends a frame above the maximum message size; the receive high-water
mark bounds what one peer can queue, in messages. It cannot bound the frames of one message:
libzmq holds a multipart message whole, however many frames it has, before its first frame can
be read (only a peer that passed ZMTP PLAIN gets that far: kvtransport.zmtp_auth). Of a message longer than any (MAX_MESSAGE_FRAMES), a link takes one
frame more than that (its handler drops the message) and skips the rest a frame at a time,
holding none. A receive takes messages for max_poll_s at most (a node's --kv-poll-ms), and
_DRAIN_BYTES at most, so that no flood of messages holds its caller's loop longer; a message
being skipped goes on at the next one. It waits for its first message on a poll, and, while a
peer owes a split batch payloads, for each next message on that poll again, for what is left of
its time (zmq_poll on items made once; no zmq.Again a payload); else it drains without waiting. Not a
blocking receive with RCVTIMEO: pyzmq restarts an interrupted one (EINTR, any signal with a
Python handler) with its whole timeout, so signals arriving faster than it would hold the loop
without end; its poll counts down what it has waited (in whole seconds only, pyzmq 27: a storm
of signals stretches a wait by up to ~1 s).

Both ends speak ZMTP PLAIN (kvtransport.zmtp_auth): the ROUTER reads nothing from a connection
whose password does not prove the cluster secret; its refusals are handed to the Receiver by
take_refused(), to be counted with the dropped frames.
"""
from __future__ import annotations

import logging
import math
import time

import zmq

from kvtransport.link import Handler, Lander, Landing, ReceiveLink
from kvtransport.log_limiter import LogLimiter
from kvtransport.session import Buffer
from kvtransport.stream_copy import copy_into
from kvtransport.zmtp_auth import ThreadGuard, connection_name, routing_id
from pdwire.messages import MAX_BATCH_BLOCKS, MAX_HEADER_BYTES, WHOLE_BATCH_BYTES

log = logging.getLogger("kvtransport")

DEFAULT_BIND = "tcp://127.0.0.1:*"
_DRAIN_BYTES = 256 * WHOLE_BATCH_BYTES   # bytes received per wake-up before leases and peers are checked:
                                         # main's 256 messages of 2 MiB, whatever size the messages are
_MESSAGE_COST = 64 << 10                 # bytes any message counts for at least (its Python), so a drain
                                         # takes 8192 messages at most
_POLLIN = int(zmq.POLLIN)                # as an int: pyzmq's flag enum costs ~4 us an operation
_NOBLOCK = int(zmq.NOBLOCK)
MAX_SPLIT_HWM = 1 << 16                  # messages one peer may queue either way where each payload is one
MAX_POLL_S = 0.02                        # a receive's work from its first message on (--kv-poll-ms): then the
                                         # node's loop serves the rest (its engine, the router, leases)
MAX_MESSAGE_FRAMES = MAX_BATCH_BLOCKS + 2   # frames of the longest sealed message (a header, a seal or a
                                         # trailer, a batch's payloads): the most a link takes of one message


def queue_hwm(queue_bytes: int, message_bytes: int, most: int) -> int:
    """The high-water mark that lets queue_bytes of messages of message_bytes queue: ZeroMQ counts
    messages, not bytes, so a form whose messages are single payloads needs many more of them
    than one whose messages are batches (one at least, `most` at most)."""
    return max(1, min(most, queue_bytes // message_bytes))


def _ms(timeout: float) -> int:
    """A poll timeout in whole milliseconds, rounded up: truncated, the last millisecond before
    a caller's deadline turned into polls of 0 ms, a busy loop (~10% of a core at 10 ms polls)."""
    return max(0, math.ceil(timeout * 1000))


def _skip(sock: zmq.Socket, until: float | None = None, most: int | None = None) -> tuple[int, int]:
    """Read the rest of the message being read into nothing, frame by frame (each buffer freed as
    it goes), until it ends, `until` (time.monotonic) passes or `most` frames are skipped:
    (frames, bytes) skipped."""
    frames = nbytes = 0
    while sock.get(zmq.RCVMORE):
        nbytes += sock.recv_into(_NOWHERE, flags=zmq.NOBLOCK)      # the frame's size; nothing copied
        frames += 1
        if (until is not None and time.monotonic() >= until) or frames == most:
            break
    return frames, nbytes


_NOWHERE = memoryview(bytearray(0))


def _copy(frame: zmq.Frame, slot: memoryview) -> int:
    """frame's size, its bytes copied into slot (one streaming copy) if it is exactly slot's size: a
    frame received zero-copy tells its size before the copy, so a wrong one writes nothing."""
    size = len(frame)
    if size == len(slot):
        copy_into(slot, frame)          # streaming stores: the slot is cold (kvtransport/stream_copy.py)
    return size


class ZmqReceiveLink(ReceiveLink):
    lands = True

    def __init__(self, secret: bytes, bind: str = DEFAULT_BIND, hwm: int = 64,
                 max_payload_bytes: int = 0, recv_hwm: int | None = None, max_poll_s: float = MAX_POLL_S) -> None:
        """hwm: messages queued per peer either way; recv_hwm, if given, the incoming ones;
        max_poll_s: the most a receive() takes messages for, from its first."""
        self._max_poll_s = max_poll_s
        self._skipping: str | None = None      # the peer whose over-long message is being skipped
        self._log = LogLimiter(log)             # per (peer, what): a flooding peer cannot flood the log
        self._ctx = zmq.Context(io_threads=1)
        self._guard = ThreadGuard(self._ctx, secret)
        self._guard.start()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._guard.protect(self._sock, hwm if recv_hwm is None else recv_hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(max_payload_bytes, MAX_HEADER_BYTES) + 64)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._handle: Handler = lambda peer, frames: None
        self._lander: Lander | None = None
        self._polled = [(self._sock, _POLLIN)]  # zmq_poll's items, made once: Socket.poll makes a Poller a
                                                # call (~8 us), and Poller.poll is a Python call around zmq_poll
        self._more = False                      # whether the message being read has a frame after the last read

    def bind(self, handle: Handler, lander: Lander | None = None) -> None:
        self._handle, self._lander = handle, lander

    def receive(self, timeout: float) -> None:
        """Drain the waiting messages, for max_poll_s from the first at most and _DRAIN_BYTES at
        most: then the caller's loop checks leases and peers and serves the rest of its node,
        however fast a peer sends; while a peer owes a split batch payloads, wait on for them,
        within timeout and max_poll_s, rather than return to the caller's loop between two of
        them. A drain ends on the zmq.Again of its last receive: one raise a drain costs less than
        asking the socket's EVENTS after every message (pyzmq's getsockopt: ~4 us)."""
        deadline, budget = time.monotonic() + timeout, _DRAIN_BYTES
        if not zmq.zmq_poll(self._polled, _ms(timeout)):
            return
        stop_at = time.monotonic() + self._max_poll_s
        while True:
            if self._skipping is not None:
                taken = self._skip_on(stop_at)
            elif (first := self._first(min(deadline, stop_at))) is None:
                return
            else:
                taken = self._take(connection_name(first))
            budget -= max(taken, _MESSAGE_COST)
            if budget <= 0 or time.monotonic() >= stop_at:
                return              # a full drain: the caller checks leases and peers

    def _first(self, until: float) -> zmq.Frame | None:
        """The next message's first frame (its routing id), or None if none came: waited for
        until `until` (time.monotonic) while a peer owes a split batch payloads, else not at all."""
        if self._lander is not None and self._lander.owing() and not zmq.zmq_poll(self._polled,
                                                                                    _ms(until - time.monotonic())):
            return None
        try:
            frame = self._sock.recv(_NOBLOCK, copy=False)     # self._frame() inlined: once a message
        except zmq.Again:
            return None
        self._more = frame.more
        return frame

    def _frame(self, flags: int = _NOBLOCK) -> zmq.Frame:
        """The next frame of the message being read (zero-copy); self._more: whether another follows."""
        frame = self._sock.recv(flags, copy=False)
        self._more = frame.more
        return frame

    def _take(self, peer: str) -> int:
        """The rest of one message from peer (libzmq hands a multipart message over whole: every
        frame is here), and its bytes. Payload frames go straight into the lander's slots when it
        has them; a peer that owes a split batch a payload has its next message received into the
        next slot. Of a message longer than any (MAX_MESSAGE_FRAMES), one frame more than that
        is taken (the handler drops it) and the rest skipped (_skip_on)."""
        owed = self._lander.owed(peer) if self._lander is not None else None
        if owed is None:
            first = self._frame().bytes if self._more else None
        elif type(first := self._pay(peer, owed)) is int:
            return first                        # a payload it owed: its bytes
        frames: list[Buffer] = [] if first is None else [first]    # the header: small, copied
        if self._more:                          # the seal if it is one (else a payload: not copied)
            frames.append(self._frame().buffer)
        lands = self._lander is not None and len(frames) == 2
        landing = self._lander.landing(peer, *frames, split=not self._more) if lands else None
        if landing is None:
            frames += self._rest(peer, len(frames))
            self._handle(peer, frames)
            return sum(len(f) for f in frames)
        head = len(frames[0]) + len(frames[1])
        if not self._more:
            return head                         # split: its payloads come as messages of their own
        sizes: list[int] = []
        start = time.perf_counter()
        for slot in landing.slots:
            if not self._more:
                break
            sizes.append(_copy(self._frame(), slot))
        sizes += [len(f) for f in self._rest(peer, 2 + len(sizes))]     # frames past the slots: sizes only
        self._lander.landed(peer, landing, sizes, time.perf_counter() - start)
        return head + sum(sizes)

    def _rest(self, peer: str, taken: int) -> list[memoryview]:
        """The rest of the message being read (zero-copy), of which `taken` frames were read: up to
        one frame more than MAX_MESSAGE_FRAMES in all; what follows is left to _skip_on."""
        rest: list[memoryview] = []
        while self._more:
            if taken + len(rest) > MAX_MESSAGE_FRAMES:
                self._skipping = peer
                break
            rest.append(self._frame().buffer)
        return rest

    def _skip_on(self, until: float) -> int:
        """Skip frames of the over-long message being read until it ends (logged) or until passes;
        their bytes."""
        frames, nbytes = _skip(self._sock, until)
        if not self._sock.get(zmq.RCVMORE):
            self._log.warning((self._skipping, "skipped"), "a message of more than %d frames from %s: the frames "
                              "past them skipped", MAX_MESSAGE_FRAMES, self._skipping)
            self._skipping = None
        return max(nbytes, frames)

    def _pay(self, peer: str, landing: Landing) -> int | bytes:
        """peer's next message, owed to landing's split batch, received into its next slot: its
        size if it is a bare payload; else (the batch ends short, dropped) its first frame, for
        the caller to take the rest of the message after it (an honest sender never interleaves,
        and the slot is a block, or a layer slice, of that peer's own claimed transfer)."""
        start = time.perf_counter()
        frame = self._sock.recv(_NOBLOCK, copy=False)         # self._frame() inlined: once a payload
        if frame.more:
            self._more = True
            self._lander.landed(peer, landing, landing.sizes, landing.seconds)
            return frame.bytes
        self._more = False
        sizes = landing.sizes
        sizes.append(size := _copy(frame, landing.slots[len(sizes)]))
        landing.seconds += time.perf_counter() - start
        if len(sizes) == len(landing.slots):
            self._lander.landed(peer, landing, sizes, landing.seconds)
        return size

    def waitables(self) -> list[zmq.Socket]:
        return [self._sock]

    def take_refused(self) -> list[str]:
        return self._guard.take_refused()

    def send(self, peer: str, frames: list[Buffer]) -> None:
        try:
            self._sock.send_multipart([routing_id(peer), *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:   # peer gone (EHOSTUNREACH) or not draining (EAGAIN)
            self._log.log(logging.INFO, (peer, "unsent"), "reply to %s not sent: %s", peer, e)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._guard.stop()
        self._ctx.term()
