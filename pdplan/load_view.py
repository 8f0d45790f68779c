"""What the router knows of a decode node's load (router/cluster/registry.py): the node's last
heartbeat, plus the router's own bookings since. The real router ranks decode nodes on this, not
on the node's state this instant, and so does the simulated one (decode_pool.py).

    heartbeat   every HEARTBEAT_S (node_shell/config.py NodeConfig.heartbeat_s), at a phase of the
                node's own: blocks in use (allocated, reservations included), sequences running
                and waiting (a reservation waiting for its blocks is neither), whether any wait;
                the bookings since are reset: the heartbeat shows them
    book        a reservation: + the blocks the node took for the prompt (its reply's
                Reserved.taken_blocks, which the router books from the reply on: the prompt's less
                the leading ones it holds and other requests use, router/cluster/admission.py
                _taken; a simulated reply is instant) and one sequence, until the next heartbeat;
                when the node prefills its uncached blocks itself (a local prefill), + those blocks
                of queued prefill work too, until the next heartbeat
    release     the request ended: - the blocks its booking counted and one sequence, until the next
                heartbeat (what it had grown by shows only then); - its queued prefill blocks
                only if no heartbeat came since it was booked (that one took them off already)

    used_blocks   = heartbeat's blocks in use + bookings' blocks since
    sequences     = heartbeat's running + waiting + bookings' sequences since
    queued_blocks = local prefills' blocks booked since the heartbeat (router/cluster/registry.py
                    unreported_prefill_blocks; routing_cost.py queued(D))

The heartbeats stop while the node is idle and its last one showed it so (a simulation then ends);
they resume on its next booking, at the same phase.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from pdplan.events import EventLoop

HEARTBEAT_S = 0.5       # node_shell/config.py NodeConfig.heartbeat_s (tests/planner/test_load_view.py)


class _Booking(NamedTuple):
    blocks: int             # blocks the node took for the prompt
    prefill_blocks: int     # prompt blocks it computes itself (a local prefill; else 0)
    beat: int               # heartbeats before it: a later one has taken its prefill blocks off


class LoadView:
    def __init__(self, engine, loop: EventLoop, phase: float, period: float = HEARTBEAT_S):
        """engine: the node's SimEngine; phase: when in [0, period) its heartbeats fall."""
        self.engine, self.loop, self.phase, self.period = engine, loop, phase, period
        self.beat_used = self.beat_seqs = 0
        self.beat_waiting = False
        self.since_blocks = self.since_seqs = self.queued_blocks = 0
        self._booked: dict[int, _Booking] = {}     # request id -> what its booking counted
        self._beats = 0
        self._beating = False

    @property
    def used_blocks(self) -> int:
        return self.beat_used + self.since_blocks

    @property
    def sequences(self) -> int:
        return self.beat_seqs + self.since_seqs

    def book(self, rid: int, blocks: int, prefill_blocks: int = 0) -> None:
        """Request `rid` reserved here, taking `blocks` blocks from the node's available ones for
        its prompt, and computing `prefill_blocks` of the prompt's blocks itself."""
        self._booked[rid] = _Booking(blocks, prefill_blocks, self._beats)
        self.since_blocks += blocks
        self.since_seqs += 1
        self.queued_blocks += prefill_blocks
        if not self._beating:
            self._beating = True
            k = math.floor((self.loop.now - self.phase) / self.period) + 1
            self.loop.at(self.phase + k * self.period, self._beat)

    def release(self, rid: int) -> None:
        """Request `rid` ended: its booking's blocks and sequence come off, and its queued prefill
        blocks if no heartbeat has yet (router/cluster/registry.py)."""
        booking = self._booked.pop(rid)
        self.since_blocks -= booking.blocks
        self.since_seqs -= 1
        if booking.beat == self._beats:
            self.queued_blocks -= booking.prefill_blocks

    def _beat(self) -> None:
        e = self.engine
        self.beat_used, self.beat_seqs, self.beat_waiting = e.pool.used, e.load(), bool(e.waiting)
        self.since_blocks = self.since_seqs = self.queued_blocks = 0
        self._beats += 1
        if e.running or e.waiting or e.reserved:
            self.loop.after(self.period, self._beat)
        else:
            self._beating = False
