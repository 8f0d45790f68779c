"""ZeroMQ's own handshake as the first gate of the node network: a peer that cannot prove it holds
the cluster secret is refused before libzmq reads a single message of its connection.

Why a second gate before the session's MAC (kvtransport.session): libzmq buffers a multipart
message whole before the application sees any frame, its high-water mark counts messages and
MAXMSGSIZE bounds each frame, so one message of many large frames from any local process would be
held in memory before the MAC check could run. With ZMTP PLAIN, a connection's messages are read
only once the ZAP handler has accepted its handshake; until then libzmq holds one handshake
command (at most MAXMSGSIZE bytes) per connection.

    connecting socket (DEALER)                       bound socket (ROUTER)
    plain_username  USERNAME                         plain_server, zap_domain ZAP_DOMAIN
    plain_password  plain_password(secret) ──ZMTP──▶ ZAP handler (zmq.auth, ThreadGuard):
                                                     the password compared in constant time;
                                                     refused: the connection is closed, and
                                                     its owner counts and logs it

The password is HMAC-SHA256(secret, PLAIN_LABEL) in hex, never the secret itself. PLAIN sends it
in clear: it keeps out the processes that cannot see the node network's traffic (other users of a
host, anyone off the path); one that sniffs a connection learns it and passes this gate, and
then still faces the session's handshake and MAC, which this does not replace.

The guard also names each connection it admits: its ZAP reply gives the connection a User-Id of
its own (a counter), which libzmq attaches to every message of that connection. A bound socket
keys its sessions by connection_name(): the routing id, which a peer chooses and a sniffer reads
off the wire, and that User-Id, which no peer can choose. A connection that takes over a closed
one's routing id is another connection, with no session, so nothing sealed for the old one is
accepted on it (its payload bytes, which the session's MAC does not cover, least of all).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
from collections import deque

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvtransport.session import check_secret

log = logging.getLogger("kvtransport")

ZAP_DOMAIN = "pdserve"
USERNAME = "pdserve"
PLAIN_LABEL = b"pdserve zmtp plain v1"

MAX_REFUSALS = 1024     # refused handshakes held until their owner's loop counts them (take_refused)
USER_ID = "User-Id"     # the message property that holds the User-Id the ZAP handler gave a connection
USER_ID_SLOTS = 1       # receive high-water mark slots a connection's User-Id holds for good (protect)
HANDSHAKE_MS = 5000     # a connection silent past this is closed: libzmq's default, 30 s, let one local process hold every fd


def plain_password(secret: bytes) -> str:
    """The ZMTP PLAIN password of the cluster secret (hex): proves the secret, does not reveal it."""
    return hmac.new(check_secret(secret), PLAIN_LABEL, hashlib.sha256).hexdigest()


def plain_client(sock: zmq.Socket | zmq.Context, secret: bytes) -> None:
    """Makes sock (before connect) present the cluster's PLAIN credentials; given a context, every
    socket it makes from now on."""
    sock.plain_username = USERNAME.encode()
    sock.plain_password = plain_password(secret).encode()


def connection_name(routing_id: zmq.Frame) -> str:
    """The connection a message came on, from its routing id frame (received with copy=False on a
    socket a ThreadGuard protects): the routing id in hex, a dot, the connection's User-Id."""
    return f"{routing_id.bytes.hex()}.{routing_id.get(USER_ID)}"


def routing_id(connection: str) -> bytes:
    """The routing id to send to a connection named by connection_name. libzmq routes by it alone:
    once that connection has closed, whichever connection took its routing id gets the message."""
    return bytes.fromhex(connection.partition(".")[0])


class ThreadGuard(ThreadAuthenticator):
    """zmq.auth's ZAP handler, on a thread of its own, with our PLAIN check: one username, the
    password derived from the secret compared in constant time, and every refusal's address kept
    (at most MAX_REFUSALS) until the owner's loop takes them to count; every connection it admits
    gets a User-Id of its own (connection_name). start() before the protected socket binds; stop()
    (joins the thread) after it closes, before the context's term(). Used by the KV receiver (a
    node's blocking loop) and the router's control server (its asyncio loop)."""

    def __init__(self, context: zmq.Context, secret: bytes) -> None:
        super().__init__(context=context, log=log)
        self._password = plain_password(secret).encode()
        self._refused: deque[str] = deque(maxlen=MAX_REFUSALS)     # appended on the guard's thread
        self._address = ""
        self._user_ids = itertools.count(1)     # taken on the guard's thread

    def take_refused(self) -> list[str]:
        """The addresses refused since the last call (on any thread)."""
        taken = []
        while self._refused:
            taken.append(self._refused.popleft())
        return taken

    def protect(self, sock: zmq.Socket, recv_hwm: int = 1000) -> None:
        """Makes sock (before bind, on this guard's context) accept only PLAIN peers this guard
        admits, and queue recv_hwm messages (0: no limit) from each connection. libzmq queues a
        connection's User-Id as a message ahead of its first, which the pipe counts as written and
        never as read: it holds one slot of the receive high-water mark for good, added here. A
        connection not through the handshake within HANDSHAKE_MS is closed."""
        sock.plain_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.handshake_ivl = HANDSHAKE_MS
        sock.rcvhwm = recv_hwm + USER_ID_SLOTS if recv_hwm > 0 else 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        ok = hmac.compare_digest(password.encode(), self._password)
        ok &= domain == ZAP_DOMAIN and username == USERNAME
        return (True, b"OK") if ok else (False, b"refused")

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        admitted = status_code == b"200"
        super()._send_zap_reply(request_id, status_code, status_text,
                                str(next(self._user_ids)) if admitted else "")
        if not admitted:
            self._refused.append(self._address)

