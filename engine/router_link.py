"""A node's link to the router: one ZMQ DEALER (routing id = node_id), hello on start and when
the router asks, a heartbeat carrying the node's figures, and messages both ways.

Malformed frames from the router are dropped and counted; they never stop the node.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from kvtransport import control
from kvtransport.control import NodeCommand, NodeHello, NodeStatus
from kvtransport.schema import ProtocolError

log = logging.getLogger(__name__)


class RouterLink:
    def __init__(self, endpoint: str, hello: NodeHello, status: Callable[[], NodeStatus],
                 heartbeat_s: float = 0.5):
        self.hello, self.status, self.heartbeat_s = hello, status, heartbeat_s
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, hello.node_id.encode())
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.MAXMSGSIZE, control.MAX_CONTROL_BYTES)
        self._sock.connect(endpoint)
        self._next_beat = 0.0
        self.dropped = 0
        self.leave = False           # the router told this node to go
        self.send(hello)

    def send(self, msg: Any) -> None:
        """Raises ProtocolError for a message the router would drop as too long."""
        frame = control.encode(msg)
        if len(frame) > control.MAX_CONTROL_BYTES:
            raise ProtocolError(f"a {type(msg).__name__} of {len(frame)} bytes is over the control "
                                f"plane's {control.MAX_CONTROL_BYTES}")
        self._sock.send(frame, copy=False)

    def poll(self, timeout: float) -> list[Any]:
        """Messages from the router that arrive within `timeout` s (all that are queued, at
        least); sends a heartbeat when one is due. Node commands are handled here."""
        now = time.monotonic()
        if now >= self._next_beat:
            self.send(self.status())
            self._next_beat = now + self.heartbeat_s
        wait = max(0.0, min(timeout, self._next_beat - now))
        messages = []
        if self._sock.poll(int(wait * 1000), zmq.POLLIN):
            while True:
                try:
                    frame = self._sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = self._decode(frame.buffer)
                if msg is not None and not self._command(msg):
                    messages.append(msg)
        return messages

    def _decode(self, buf) -> Any:
        try:
            return control.decode(buf)
        except ProtocolError as e:
            self.dropped += 1
            log.warning("dropped a malformed frame from the router: %s", e)
            return None

    def _command(self, msg: Any) -> bool:
        if not isinstance(msg, NodeCommand):
            return False
        if msg.command == "register":
            self.send(self.hello)
        elif msg.command == "leave":
            self.leave = True
        return True

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
