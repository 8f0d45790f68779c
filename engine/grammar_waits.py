"""GrammarWaits: requests parked until their grammar compiled (engine/grammar_jobs.py), so the
loop that took them (a node's, the colocated engine thread's) never waits for a compile: it
heartbeats and serves the others, and each turn takes back the requests whose wait is over.

A request waits at most the time limit for a compile thread (then GrammarBusy: another node may
be free), at most --grammar-worker-start-timeout-s for that thread's worker process to start
(GrammarBusy too), and at most the time limit once it compiles (then ValueError: this grammar is
too costly for any node, a 400). A request that leaves (settled, dropped, cleared) leaves its job: the last
to leave a job still queued cancels it; one running is abandoned (its worker process killed).
"""
from __future__ import annotations

import time
from typing import Generic, NamedTuple, TypeVar

from engine.grammar_jobs import CompileJob

T = TypeVar("T")


class Settled(NamedTuple, Generic[T]):
    """A request whose wait is over, handed back to the loop that parked it."""
    rid: str
    item: T                             # what the caller parked (its request)
    error: Exception | None             # None: compiled (or failed to: add_request says so)


class GrammarWaits(Generic[T]):
    """The requests one loop parked, by request id; only that loop's thread touches it."""

    def __init__(self) -> None:
        self._parked: dict[str, tuple[CompileJob, float, T]] = {}   # rid -> (job, parked at, item)

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, rid: str) -> bool:
        return rid in self._parked

    def park(self, rid: str, job: CompileJob, item: T) -> None:
        """`item` waits for `job` until settled() hands it back (or drop, clear)."""
        if (old := self._parked.get(rid)) is not None:
            old[0].leave()
        job.join()
        self._parked[rid] = (job, time.monotonic(), item)

    def drop(self, rid: str) -> T | None:
        """The request leaves (aborted): its item, or None if it was not parked."""
        parked = self._parked.pop(rid, None)
        if parked is None:
            return None
        parked[0].leave()
        return parked[2]

    def clear(self) -> None:
        """Every request leaves (the router's session was lost)."""
        parked, self._parked = self._parked, {}
        for job, _, _ in parked.values():
            job.leave()

    def settled(self) -> list[Settled[T]]:
        """The requests whose compile ended or whose wait is over, in the order they were parked."""
        out = []
        for rid, (job, parked_at, item) in list(self._parked.items()):
            error = None if job.done else job.expired(parked_at)
            if job.done or error is not None:
                del self._parked[rid]
                job.leave()
                out.append(Settled(rid, item, error))
        return out
