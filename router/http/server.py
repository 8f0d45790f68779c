"""Serving the app over HTTP: uvicorn, with connection hygiene (router/http/connection.py), slots
sized to the process's file descriptors (router/http/descriptors.py) and a bounded shutdown.

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
import logging
import socket
from typing import Any

import uvicorn

from router.config import RouterConfig
from router.http.connection import ConnectionLimits, GuardedProtocol
from router.http.connection_slots import ConnectionSlots
from router.http.descriptors import fitted_max_connections

log = logging.getLogger(__name__)
_CANCEL_AFTER_S = 2.0      # after the grace period: time for the error events to go out


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
        limits = ConnectionLimits(config.header_timeout_s, config.body_timeout_s, config.stream_stall_timeout_s)
        slots = ConnectionSlots(fitted_max_connections(config.max_connections, config.max_refusals, config.reserved_fds),
                                config.max_refusals)
        super().__init__(uvicorn.Config(
            app, host=config.host, port=config.port,
            http=functools.partial(GuardedProtocol, limits=limits, slots=slots),
            ws="none",      # an upgrade would hand the connection to a protocol that keeps no slot
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
