"""Who holds the router's HTTP connection slots, and who gives one up to a new connection.

    a new connection ──▶ fewer than max_connections served? ── yes ──────────────────────▶ served
                              │ no
                              ▼
         a served connection whose request is incomplete (its headers or body still coming) and
         whose last response is all sent?
                              │ yes: the one silent longest is closed; the new one is served
                              │ no: every slot runs a request (or sends a response's end)
                              ▼
         fewer than max_refusals connections being refused? ── yes ──▶ a 503, then closed
                              │ no
                              ▼
                        closed at once, unanswered

A client that never completes a request (slowloris: one byte, then nothing) holds a slot only until
a connection that needs one arrives; a slot whose request the app has is never taken. nginx closes
only the connections it calls reusable (waiting for a request's first byte, or idle between
keep-alive requests) when worker_connections run out, never one reading a request; here a slot is
safe only once its whole request (headers and body) has arrived, but the line is ordered by the
last byte each connection sent, so a client still sending its request is closed only after every
silent one. Connections held are therefore at most max_connections + max_refusals, besides evicted
ones finishing their last response within a second (router/http/descriptors.py sizes the process's
descriptors to it).
"""
from __future__ import annotations

from collections import OrderedDict
from enum import Enum
from typing import Protocol


class Admission(Enum):
    SERVE = "serve"
    REFUSE = "refuse"       # answered with a 503, then closed
    DROP = "drop"           # closed at once: max_refusals are being refused already


class Slot(Protocol):
    def sending(self) -> bool:
        """Whether output is still going out to it (a response's end): it is not evicted then."""

    def evict(self) -> None:
        """Close now: a new connection takes this one's slot (its request is incomplete)."""


class ConnectionSlots:
    def __init__(self, max_connections: int, max_refusals: int):
        self.max_connections = max_connections
        self.max_refusals = max_refusals
        self._served: set[Slot] = set()
        self._waiting: OrderedDict[Slot, None] = OrderedDict()  # served, request incomplete; silent longest first
        self._refusing: set[Slot] = set()

    def admit(self, conn: Slot) -> Admission:
        """What becomes of a new connection; may evict one that waits for its request."""
        if len(self._served) >= self.max_connections:
            victim = next((c for c in self._waiting if not c.sending()), None)
            if victim is not None:
                self.left(victim)
                victim.evict()
        if len(self._served) < self.max_connections:
            self._served.add(conn)
            return Admission.SERVE
        if len(self._refusing) < self.max_refusals:
            self._refusing.add(conn)
            return Admission.REFUSE
        return Admission.DROP

    def waiting(self, conn: Slot) -> None:
        """A served connection waits for a request's headers or body, and has just sent a byte of
        it (or started to wait): it may be evicted, after every connection silent longer."""
        if conn in self._served:
            self._waiting[conn] = None
            self._waiting.move_to_end(conn)

    def running(self, conn: Slot) -> None:
        """The app has the connection's whole request: its slot is safe."""
        self._waiting.pop(conn, None)

    def left(self, conn: Slot) -> None:
        """The connection closed (any way, any state); idempotent."""
        self._served.discard(conn)
        self._waiting.pop(conn, None)
        self._refusing.discard(conn)
