"""One HTTP connection at the router's edge: uvicorn's h11 protocol with a deadline for each phase
of a request, and a slot (router/http/connection_slots.py) it holds while open.

    accepted ─ headers within header_timeout_s ─▶ request ─ body within body_timeout_s ─▶ app
       ▲                                                                                  │
       └──────── keep-alive: idle keep_alive_timeout_s, then the next request's headers ◀─┘

    - until the app has its whole request (headers and body), the connection may lose its slot
      to a new connection when all max_connections slots are taken: it is closed
    - a client that accepts no data for stream_stall_timeout_s while a response waits to be
      written (the transport's buffer stays full) is cut; the app sees a disconnect and the
      request is aborted on every node
    - a connection closing (Connection: close, HTTP/1.0, a malformed request) with output unsent
      has stall_timeout_s to read it, then is cut
    - a connection that finds every slot running a request is answered at once with a 503 in
      OpenAI's shape and closed, before it sends anything (at most max_refusals at a time; beyond
      them it is closed unanswered)
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.http.connection_slots import Admission, ConnectionSlots
from router.http.errors import error_body, unavailable

log = logging.getLogger(__name__)
_LINGER_S = 1.0     # a connection the router closes with data still going out (a 503, the end of its last
                    # response) has this long to read it before it is reset


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    stall_timeout_s: float


@functools.cache
def _too_many(max_connections: int) -> bytes:
    """The whole HTTP response to a connection over the limit: a 503 in OpenAI's error shape."""
    error = unavailable(f"the router's {max_connections} connections (--max-connections) all run requests; "
                        "retry later")
    body = json.dumps(error_body(error)).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each phase of a request (see the module doc)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, slots: ConnectionSlots, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._slots = slots
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = ""            # "headers" | "body" | "" (the app has the request)
        self._stall: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        admission = self._slots.admit(self)
        if admission is Admission.SERVE:
            return self._expect("headers")
        self._refused = True                # a refused connection's request is never read
        if admission is Admission.REFUSE:
            return self._refuse()
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._follow_request()
        if self._phase:
            self._slots.waiting(self)       # heard from: to the back of the line of those evictable

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
        self._watch_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._slots.left(self)
        self._cancel_deadline()
        self._cancel_stall()
        super().connection_lost(exc)

    def sending(self) -> bool:
        return self.transport.get_write_buffer_size() > 0

    def evict(self) -> None:
        log.debug("closing the connection from %s: a new connection takes its slot (--max-connections "
                  "reached, its request incomplete)", self.client)
        self._cancel_deadline()
        self.transport.close()      # at once, unless its last response is still going out
        self._deadline = self.loop.call_later(_LINGER_S, self.transport.abort)

    def _follow_request(self) -> None:
        """Moves the deadline with the request: h11's view of the client says which phase it is in."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else ""
        if phase != self._phase:
            self._expect(phase)
        self._watch_close()

    def _watch_close(self) -> None:
        """Closing with output unsent (under the high-water mark, pause_writing never comes): the
        client has stall_timeout_s to read it, or the close would wait forever."""
        if self._stall is None and self.transport.is_closing() and self.transport.get_write_buffer_size():
            self._stall = self.loop.call_later(self._limits.stall_timeout_s, self._cut, "closing, its output unread")

    def _expect(self, phase: str) -> None:
        self._cancel_deadline()
        self._phase = phase
        if not phase:
            return self._slots.running(self)
        self._slots.waiting(self)
        timeout = self._limits.header_timeout_s if phase == "headers" else self._limits.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._cut, f"no complete {phase} in {timeout} s")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _cancel_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _refuse(self) -> None:
        """Every slot runs a request: the 503, then our side shut; the client closes (or we do, in
        _LINGER_S), so the response is not lost to a reset of the request bytes left unread."""
        self.transport.write(_too_many(self._slots.max_connections))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._deadline = self.loop.call_later(_LINGER_S, self.transport.abort)

    def _cut(self, why: str) -> None:
        log.info("closing the connection from %s: %s", self.client, why)
        self._cancel_deadline()
        self._cancel_stall()
        self.transport.abort()      # drops unsent data; connection_lost tells the app
