"""The ZMQ link's send side: a DEALER socket per decode node (the receive side: kvtransport.zmq_link).

Payload frames alias pool blocks (copy=False); the last frame of a tracked message
(its last payload, or the trailer after them) carries a zmq tracker, done once libzmq has
released it. libzmq releases the parts of the messages queued on one connection in order (its
encoder takes the next part once one is written, and a closing pipe drops them in order), so
that tracker also covers every payload sent before it on that connection: the Sender tracks one
message per send_blocks call, as a tracker costs ~40 us of Python (an Event and the tracker object). The send high-water mark gives backpressure: a send blocks while
`hwm` messages are queued for a peer, then raises TransportError after `send_timeout` seconds.
The routing id is node_id/<64 random bits> per connection, so a restarted or reconnected sender
is a new peer to the receiver, and no other process can guess it to take the connection's place.
Replies are small: see ZmqSendLink. Both ends speak ZMTP PLAIN (kvtransport.zmtp_auth).
"""
from __future__ import annotations

import secrets
import time

import zmq

from kvtransport.base import TransportError
from kvtransport.link import Completion, DropHandler, Dropped, Handler, SendLink
from kvtransport.metrics import DropReason
from kvtransport.session import Buffer
from kvtransport.zmq_link import MAX_POLL_S, _ms, _skip
from kvtransport.zmtp_auth import plain_client
from pdwire.messages import MAX_HEADER_BYTES

MAX_REPLY_FRAMES = 2                     # frames of the longest reply to a sender: [header, trailer]
MAX_REPLY_BYTES = MAX_HEADER_BYTES + 64  # a reply's largest frame (a header; a trailer or an auth frame is less):
                                         # the sender's MAXMSGSIZE
MAX_SKIP_FRAMES = 1 << 10                # frames of a dropped reply a send link skips per call (~3 us each here)


class ZmqSendLink(SendLink):
    """Replies are small: a connection's frames above MAX_REPLY_BYTES disconnect it (libzmq's
    MAXMSGSIZE, as on the receive side), and a reply of more than MAX_REPLY_FRAMES is Dropped (for
    the caller to count) and its rest skipped, MAX_SKIP_FRAMES a call and within the call's time
    at most, the rest at the next calls. receive() serves the connections in turn, one reply
    each, from the one after the last it served: a decode node that replies without pause does
    not keep another's replies waiting past the call's time (max_poll_s)."""

    def __init__(self, node_id: str, secret: bytes, hwm: int = 64, send_timeout: float = 10.0,
                 send_hwm: int | None = None, max_poll_s: float = MAX_POLL_S) -> None:
        """hwm: messages queued per connection either way; send_hwm, if given, the outgoing ones;
        max_poll_s: the most a receive() takes messages for, from its first."""
        self._node_id, self._hwm, self._send_timeout = node_id, hwm, send_timeout
        self._max_poll_s = max_poll_s
        self._send_hwm = hwm if send_hwm is None else send_hwm
        self._secret = secret
        self._ctx = zmq.Context(io_threads=1)
        self._socks: dict[str, zmq.Socket] = {}     # every open connection
        self._live: set[str] = set()                # those paired
        self._skipping: set[str] = set()            # those whose over-long reply is being skipped
        self._last: str | None = None               # the connection receive() served last

    def open(self, endpoint: str) -> None:
        sock = self._socks[endpoint] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"{self._node_id}/{secrets.token_hex(8)}".encode())
        sock.setsockopt(zmq.SNDHWM, self._send_hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.SNDTIMEO, int(self._send_timeout * 1000))
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.setsockopt(zmq.LINGER, 1000)
        plain_client(sock, self._secret)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:       # e.g. a malformed endpoint, or a host that does not resolve
            self.close(endpoint)
            raise TransportError(f"cannot connect to {endpoint!r}: {e}") from None

    def recv(self, endpoint: str, timeout: float) -> list[Buffer] | Dropped | None:
        if not self._socks[endpoint].poll(_ms(timeout), zmq.POLLIN):
            return None
        return self._next(endpoint, time.monotonic() + self._max_poll_s)

    def paired(self, endpoint: str) -> None:
        self._live.add(endpoint)

    def send(self, endpoint: str, frames: list) -> None:
        """Payload frames of 64 KiB and more (pyzmq's copy threshold) leave zero-copy, untracked:
        the caller tracks a later message on this connection (send_tracked)."""
        try:
            self._socks[endpoint].send_multipart(frames, copy=False)
        except zmq.Again:
            raise TransportError(f"{endpoint} not draining: send blocked {self._send_timeout}s") from None

    def send_each(self, endpoint: str, frames: list[Buffer]) -> None:
        """As send() of each frame alone, in one loop of pyzmq sends: send_multipart wraps each in
        a Python loop of type checks (a split batch's payloads: up to 64 a message)."""
        send = self._socks[endpoint].send
        try:
            for frame in frames:
                send(frame, copy=False)
        except zmq.Again:
            raise TransportError(f"{endpoint} not draining: send blocked {self._send_timeout}s") from None

    def send_tracked(self, endpoint: str, frames: list[Buffer]) -> Completion:
        *head, last = frames        # released after every frame before it (see above)
        tracked = zmq.Frame(last, copy=False, track=True)
        self.send(endpoint, [*head, tracked])
        return tracked.tracker

    def try_send(self, endpoint: str, frames: list[Buffer]) -> None:
        try:
            self._socks[endpoint].send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass     # queue full: the blocks in it prove we are alive anyway

    def receive(self, timeout: float, handle: Handler, drop: DropHandler) -> None:
        live = [e for e in self._socks if e in self._live]
        if not live:
            if timeout > 0:
                time.sleep(timeout)
            return
        poller = zmq.Poller()
        for endpoint in live:
            poller.register(self._socks[endpoint], zmq.POLLIN)
        ready = dict(poller.poll(_ms(timeout)))
        stop_at = time.monotonic() + self._max_poll_s
        turns = [e for e in self._after_last(live) if self._socks[e] in ready]
        while turns:
            for endpoint in list(turns):      # a reply each, in turn
                reply = self._next(endpoint, stop_at)
                if reply is None:
                    turns.remove(endpoint)
                    continue
                self._last = endpoint
                (drop if type(reply) is Dropped else handle)(endpoint, reply)
                if time.monotonic() >= stop_at:
                    return

    def _after_last(self, endpoints: list[str]) -> list[str]:
        """endpoints in turn from the one after the last served (from the first if it is gone)."""
        k = endpoints.index(self._last) + 1 if self._last in endpoints else 0
        return endpoints[k:] + endpoints[:k]

    def _next(self, endpoint: str, until: float) -> list[bytes] | Dropped | None:
        """endpoint's next reply (copied: replies are small), Dropped if it has more frames than
        any; None if none is waiting, or the rest of a dropped one is still being skipped."""
        sock = self._socks[endpoint]
        if endpoint in self._skipping and not self._skip_reply(endpoint, until):
            return None
        try:
            frames = [sock.recv(zmq.NOBLOCK)]
        except zmq.Again:
            return None
        while sock.get(zmq.RCVMORE) and len(frames) < MAX_REPLY_FRAMES:
            frames.append(sock.recv(zmq.NOBLOCK))
        if not sock.get(zmq.RCVMORE):
            return frames
        self._skipping.add(endpoint)
        self._skip_reply(endpoint, until)
        return Dropped(DropReason.MALFORMED, f"a reply of more than {MAX_REPLY_FRAMES} frames")

    def _skip_reply(self, endpoint: str, until: float) -> bool:
        """Skip frames of endpoint's dropped reply (MAX_SKIP_FRAMES at most, until at the latest);
        whether it has ended."""
        sock = self._socks[endpoint]
        _skip(sock, until, MAX_SKIP_FRAMES)
        if sock.get(zmq.RCVMORE):
            return False
        self._skipping.discard(endpoint)
        return True

    def waitables(self) -> list[zmq.Socket]:
        return list(self._socks.values())

    def endpoints(self) -> list[str]:
        return list(self._socks)

    def close(self, endpoint: str, linger: float = 0.0) -> None:
        self._live.discard(endpoint)
        self._skipping.discard(endpoint)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=int(linger * 1000))

    def shutdown(self) -> None:
        self._ctx.term()
