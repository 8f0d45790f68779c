"""Serving the app over HTTP: uvicorn, with connection hygiene and a bounded shutdown.

A connection's life (GuardedProtocol, over uvicorn's h11 protocol):

    accepted ─ headers within header_timeout_s ─▶ request ─ body within body_timeout_s ─▶ app
       ▲                                                                                  │
       └──────── keep-alive: idle keep_alive_timeout_s, then the next request's headers ◀─┘

    - a client that accepts no data for stream_stall_timeout_s while a response waits to be
      written (the transport's buffer stays full) is cut; the app sees a disconnect and the
      request is aborted on every node
    - a connection beyond max_connections open ones is answered at once with a 503 in OpenAI's
      shape and closed, before it sends anything

Shutdown (Server):
    1. SIGTERM or SIGINT: stop accepting at once; idle connections close; running requests go on
    2. shutdown_grace_s later: every running request ends, a stream with an error event in
       OpenAI's shape, a whole response with a 503 (app.end_all_streams)
    3. _CANCEL_AFTER_S later uvicorn cancels whatever is left (a client that reads nothing) and
       serve() returns
    a second SIGTERM or SIGINT at any point: serve() returns at once
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import RouterConfig
from router.http.errors import error_body, unavailable

log = logging.getLogger(__name__)
_CANCEL_AFTER_S = 2.0      # after the grace period: time for the error events to go out


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    stall_timeout_s: float
    max_connections: int


@functools.cache
def _too_many(max_connections: int) -> bytes:
    """The whole HTTP response to a connection over the limit: a 503 in OpenAI's error shape."""
    error = unavailable(f"the router has its {max_connections} connections (--max-connections) open; retry later")
    body = json.dumps(error_body(error)).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each phase of a request (see the module doc)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""            # "headers" | "body" | "" (the app has the request)
        self._stall: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            return self._refuse()
        self._expect("headers")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return                      # a refused connection's request is never read
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self._limits.stall_timeout_s, self._cut, "stalled reader")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_stall()

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect("")
        self._cancel_stall()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Moves the deadline with the request: h11's view of the client says which phase it is in."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else ""
        if phase != self._phase:
            self._expect(phase)

    def _expect(self, phase: str) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase:
            timeout = self._limits.header_timeout_s if phase == "headers" else self._limits.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._cut, f"no complete {phase} in {timeout} s")

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _refuse(self) -> None:
        """Over max_connections: the 503, then our side shut; the client closes (or we do, in 1 s),
        so the response is not lost to a reset of the request bytes left unread."""
        self._refused = True
        self.transport.write(_too_many(self._limits.max_connections))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._deadline = self.loop.call_later(1.0, self.transport.abort)

    def _cut(self, why: str) -> None:
        log.info("closing the connection from %s: %s", self.client, why)
        self._deadline = self._stall = None
        self.transport.abort()      # drops unsent data; connection_lost tells the app


class PortInUse(OSError):
    """The HTTP port cannot be bound; the message is the one line to show."""


def bind_http(config: RouterConfig) -> socket.socket:
    """The HTTP port, bound now (before any model loads) for `Server.serve(sockets=[...])`.
    Raises PortInUse when it is taken or not ours to bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
    try:
        sock.bind((config.host, config.port))
    except OSError as err:
        sock.close()
        raise PortInUse(f"pdserve: cannot listen on {config.host}:{config.port}: {err.strerror} "
                        "(is another server running there? choose one with --host / --port)") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with the bounded shutdown of the module doc."""

    def __init__(self, app: Any, config: RouterConfig, **uvicorn_kwargs: Any):
        limits = ConnectionLimits(config.header_timeout_s, config.body_timeout_s, config.stream_stall_timeout_s,
                                  config.max_connections)
        super().__init__(uvicorn.Config(
            app, host=config.host, port=config.port, http=functools.partial(GuardedProtocol, limits=limits),
            timeout_keep_alive=config.keep_alive_timeout_s,
            timeout_graceful_shutdown=config.shutdown_grace_s + _CANCEL_AFTER_S, **uvicorn_kwargs))
        self._app = app
        self._grace_s = config.shutdown_grace_s
        self._grace: asyncio.TimerHandle | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True      # the second signal: out at once
            return
        self.should_exit = True
        loop = asyncio.get_event_loop()
        self._grace = loop.call_soon_threadsafe(loop.call_later, self._grace_s, self._end_streams)

    def _end_streams(self) -> None:
        from router.http.app import end_all_streams
        ended = end_all_streams(self._app, f"the server is shutting down (its {self._grace_s} s grace period "
                                           "for running requests is over)")
        log.info("shutdown grace period over: ended %d running request(s)", ended)
