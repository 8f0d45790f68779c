"""A node's link to the router: one ZMQ DEALER, an authenticated session, hello, heartbeats.

    connect ─▶ handshake (kvtransport.session) ─▶ NodeHello (new epoch) ─▶ serving ─┐
       ▲                                                                           │
       └──── lost: the router sent RESET, a send would block, or no reply to ───────┘
             heartbeats for timeout_s; on_reset() drops this node's work, which the
             router fails over when it sees the new epoch

Nothing here blocks: sends never wait (a full queue means the router stopped reading, and the
link starts over), and replies are polled with the caller's timeout, in one wait with the
caller's other sockets (its KV transport's), so an idle node sleeps until any of them has input.
Frames that fail authentication or decoding are dropped and counted; they never stop the node.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Sequence

import zmq

from pdwire import control
from pdwire.control import NodeCommand, NodeGoodbye, NodeHello, NodeStatus
from kvtransport.framing import FrameError, control_framer
from pdwire.handshake import new_epoch
from pdwire.schema import MAX_TEXT_LEN
from kvtransport.session import AuthKind, Initiator, Session, parse_auth_frame
from kvtransport.zmtp_auth import plain_client

log = logging.getLogger(__name__)

_HANDSHAKE_RETRY_S = 1.0    # a hello unanswered this long is sent again on a fresh socket


class RouterLink:
    def __init__(self, endpoint: str, secret: bytes, hello: Callable[[str], NodeHello],
                 status: Callable[[str], NodeStatus], heartbeat_s: float = 0.5, timeout_s: float = 10.0,
                 on_reset: Callable[[], None] = lambda: None, send_hwm: int = 1000) -> None:
        """hello(epoch) and status(epoch) make this node's NodeHello and heartbeat; on_reset() is
        called when an established session is lost (the node's work there is gone). The session
        is lost when the router answers none of at least 3 heartbeats over timeout_s, or when
        send_hwm messages are queued (the router stopped reading)."""
        self._endpoint, self._hello, self._status = endpoint, hello, status
        self.heartbeat_s, self._timeout_s, self._on_reset = heartbeat_s, timeout_s, on_reset
        self._send_hwm = send_hwm
        self._initiator = Initiator(secret)
        self._secret = secret
        self._framer = control_framer()
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket | None = None
        self._session: Session | None = None
        self.epoch = ""
        self.dropped = 0             # frames from the router that failed authentication or decoding
        self.resets = 0              # established sessions lost
        self.leave = False           # the router told this node to go
        self.hellos = 0              # NodeHellos sent: after each, the router knows nothing of this node's cache
        self._start_handshake()

    @property
    def connected(self) -> bool:
        return self._session is not None

    def send(self, msg: Any) -> None:
        """Queue msg for the router; dropped if no session is up (on_reset has dropped its
        request). Raises ProtocolError for a message above the control plane's size limit."""
        if self._session is None:
            return
        frames = self._framer.pack(self._session, msg)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._lose("the router is not reading (send queue full)")

    def poll(self, timeout: float, wake_on: Sequence[zmq.Socket] = ()) -> list[Any]:
        """Messages from the router that arrive within `timeout` s (all that are queued, at
        least), the wait cut short as soon as one of `wake_on` (e.g. the KV transport's sockets,
        which the caller reads next) has input; sends a heartbeat when one is due. Node commands
        are handled here."""
        self.beat_if_due()
        wait = max(0.0, min(timeout, self._next_beat - time.monotonic()))
        messages = []
        if self._ready(math.ceil(wait * 1000), wake_on):
            while self._sock is not None:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = self._receive([f.buffer for f in frames])
                if msg is not None and not self._command(msg):
                    messages.append(msg)
        return messages

    def _ready(self, wait_ms: int, wake_on: Sequence[zmq.Socket]) -> bool:
        """Whether the router's socket has input, waiting up to wait_ms for it or for input on
        any of wake_on (one wait in the kernel over them all: a node with nothing to step sleeps)."""
        if not wake_on or wait_ms == 0:
            return bool(self._sock.poll(wait_ms, zmq.POLLIN))
        ready = zmq.zmq_poll([(self._sock, zmq.POLLIN), *((s, zmq.POLLIN) for s in wake_on)], wait_ms)
        return any(s is self._sock for s, _ in ready)

    def goodbye(self, reason: str) -> None:
        """Tell the router this node is leaving (if a session is up); close() lets it go out."""
        self.send(NodeGoodbye(self._hello(self.epoch).node_id, self.epoch, reason[:MAX_TEXT_LEN]))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=500)
        self._ctx.term()

    # ------------------------------------------------------------ session

    def _start_handshake(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.SNDHWM, self._send_hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, control.MAX_CONTROL_BYTES)
        plain_client(self._sock, self._secret)      # ZMTP PLAIN: the router reads nothing else
        self._sock.connect(self._endpoint)
        self._session, self.epoch = None, new_epoch()
        self._sock.send(self._initiator.hello(), zmq.NOBLOCK)
        now = time.monotonic()
        self._next_beat, self._handshake_at, self._last_heard, self._beats = now, now, now, 0

    def _lose(self, why: str) -> None:
        """The session is gone: start a new one (new epoch) and drop this node's work."""
        was_up = self._session is not None
        log.warning("lost the router's session (%s): registering again", why)
        self._start_handshake()
        if was_up:
            self.resets += 1
            self._on_reset()

    def beat_if_due(self) -> None:
        """Send a heartbeat if one is due (and retry a stalled handshake, or lose a silent session).
        poll() calls it; a caller that holds the loop between polls (a KV move's ship) calls it too."""
        now = time.monotonic()
        if self._session is None:
            if now - self._handshake_at > _HANDSHAKE_RETRY_S:
                self._start_handshake()
            return
        if self._beats >= 3 and now - self._last_heard > self._timeout_s:
            return self._lose(f"no reply to {self._beats} heartbeats")
        if now >= self._next_beat:
            self.send(self._status(self.epoch))
            self._beats += 1
            self._next_beat = now + self.heartbeat_s

    def _receive(self, frames: list) -> Any:
        """The router's message in frames, or None (handshake frames are handled here)."""
        auth = parse_auth_frame(frames)
        if auth is not None and auth[0] is AuthKind.CHALLENGE and self._session is None:
            self._session = self._initiator.on_challenge(auth[1])
            self._send_hello()
            log.info("registered with the router at %s", self._endpoint)
            return None
        if auth is not None and auth[0] is AuthKind.RESET:
            self._lose("the router has no session for this node")
            return None
        if self._session is None:
            return self._drop("a message before the handshake")
        try:
            msg, _ = self._framer.unpack(self._session, frames)
        except FrameError as e:
            return self._drop(str(e))
        self._last_heard, self._beats = time.monotonic(), 0
        return msg

    def _send_hello(self) -> None:
        self.send(self._hello(self.epoch))
        self.hellos += 1

    def _drop(self, why: str) -> None:
        self.dropped += 1
        log.warning("dropped a frame from the router: %s", why)

    def _command(self, msg: Any) -> bool:
        if not isinstance(msg, NodeCommand):
            return False
        if msg.command == "register":
            self._send_hello()
        elif msg.command == "leave":
            self.leave = True
        return True
