"""Both ends of an authenticated control-plane session, for tests that stand in for a node
(a DEALER) or for the router (a ROUTER) over real ZMQ sockets."""
from __future__ import annotations
from kvtransport.framing import control_framer

from typing import Any

from pdwire import control
from pdwire.control import NodeHello
from kvtransport.session import AuthKind, Initiator, Responder, Session, parse_auth_frame
from kvtransport.testing import TEST_SECRET


class NodeEnd:
    """A node's end: hello() to send, then every frame from the router through receive()."""

    def __init__(self, secret: bytes = TEST_SECRET) -> None:
        self._initiator = Initiator(secret)
        self._framer = control_framer()
        self.session: Session | None = None
        self.resets = 0

    def hello(self) -> list[bytes]:
        self.session = None
        return [self._initiator.hello()]

    def receive(self, frames: list) -> Any:
        """The router's message, or None for a handshake frame (a challenge opens the session)."""
        auth = parse_auth_frame(frames)
        if auth is not None:
            if auth[0] is AuthKind.CHALLENGE:
                self.session = self._initiator.on_challenge(auth[1])
            else:
                self.resets += 1
            return None
        return self._framer.unpack(self.session, frames).msg

    def seal(self, msg: Any) -> list[bytes]:
        return self._framer.pack(self.session, msg)


class RouterEnd:
    """The router's end over one ROUTER socket: answers handshakes, tracks which connection
    said hello as which node."""

    def __init__(self, secret: bytes = TEST_SECRET) -> None:
        self._auth = Responder(secret)
        self._framer = control_framer()
        self.peers: dict[str, bytes] = {}       # node id -> routing id

    def receive(self, frames: list[bytes]) -> tuple[list[list[bytes]], str | None, Any]:
        """(frames to send back, node id, message) for one [routing id, ...] message; the
        message is None for handshake frames."""
        peer, frames = frames[0], frames[1:]
        auth = parse_auth_frame(frames)
        if auth is not None:
            return [[peer, self._auth.challenge(peer.hex(), auth[1])]], None, None
        _, opened = self._auth.open(peer.hex(), frames)
        msg = self._framer.decode(opened).msg
        if isinstance(msg, NodeHello):
            self.peers[msg.node_id] = peer
        node = next((n for n, p in self.peers.items() if p == peer), None)
        return [], node, msg

    def seal(self, node_id: str, msg: Any) -> list[bytes]:
        peer = self.peers[node_id]
        return [peer, *self._framer.pack(self._auth.session(peer.hex()), msg)]
