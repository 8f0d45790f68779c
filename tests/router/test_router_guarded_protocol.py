"""GuardedProtocol (router/http/connection.py) with its slots, in-process: uvicorn on loopback.
A closing connection whose client reads nothing is cut; a client still sending keeps its slot."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from router.http.connection import ConnectionLimits, GuardedProtocol
from router.http.connection_slots import ConnectionSlots
from tests.router_process import closed_by_peer, read_until_closed

BODY = b"x" * 8192
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": BODY})


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def _serving(slots: ConnectionSlots, limits: ConnectionLimits):
    """(port, server, the protocols made so far, in order)."""
    protocols: list[GuardedProtocol] = []

    def protocol(*args, **kwargs):
        protocols.append(GuardedProtocol(*args, limits=limits, slots=slots, **kwargs))
        return protocols[-1]

    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=0, http=protocol, loop="asyncio",
                                           lifespan="off", log_level="warning", timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert _until(lambda: server.started, 30)
        yield server.servers[0].sockets[0].getsockname()[1], server, protocols
    finally:
        server.should_exit = True
        thread.join(30)


def _connect(port: int, protocols: list, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    made = len(protocols)           # before connecting: the server may make its protocol before connect returns
    sock.connect(("127.0.0.1", port))
    assert _until(lambda: len(protocols) > made, 30)
    return sock


def _status(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = read_until_closed(sock, 10)
    return int(answer.split()[1]) if answer else 0      # 0: closed unanswered (max_refusals reached)


def test_a_closing_connection_whose_client_reads_nothing_gives_up_its_slot():
    """Pipelined GETs, never read, until the kernel's buffers are full and a little output waits in
    the transport (under its high-water mark: no pause_writing), then one with Connection: close.
    The router closes the connection, which would wait forever for the client to read; it is cut
    at stall_timeout_s, so the one slot serves a new client again."""
    slots = ConnectionSlots(max_connections=1, max_refusals=4)
    with _serving(slots, ConnectionLimits(60, 60, 1.0)) as (port, server, protocols):
        client = _connect(port, protocols, rcvbuf=4096)
        sent = 0
        while sent < 2000 and not protocols[0].transport.get_write_buffer_size():
            client.sendall(GET * 4)     # 32 KiB of responses: the transport holds less than 64 KiB
            sent += 4
            assert _until(lambda: server.server_state.total_requests == sent, 30)
        assert protocols[0].transport.get_write_buffer_size() and protocols[0]._stall is None
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _until(lambda: protocols[0].transport.is_closing(), 30)
        assert _until(lambda: _status(port) == 200, 30)         # cut: never, before the fix (503s)
        client.close()


def test_a_client_still_sending_its_request_is_evicted_after_a_silent_one():
    """Two slots: a connects, then b; a sends part of its headers; a third connection takes the
    slot of b, silent longest, not of a, which waited longer but was heard from since."""
    slots = ConnectionSlots(max_connections=2, max_refusals=1)
    with _serving(slots, ConnectionLimits(60, 60, 60)) as (port, server, protocols):
        a = _connect(port, protocols)
        b = _connect(port, protocols)
        a.sendall(b"GET / HTTP/1.1\r\n")
        assert _until(lambda: protocols[0].conn.trailing_data[0], 30)
        c = _connect(port, protocols)
        assert closed_by_peer(b, 10) and not closed_by_peer(a, 0.5)
        for sock in (a, b, c):
            sock.close()
