"""GrammarWaits: requests parked until their grammar compiled (engine/grammar_jobs.py), so the
loop that took them (a node's, the colocated engine thread's) never waits for a compile: it
heartbeats and serves the others, and each turn takes back the requests whose wait is over.

A request waits at most the time limit for its compile to start (then GrammarBusy: another node
may be free) and at most the time limit once it runs (then ValueError: this grammar is too costly
for any node, a 400).
"""
from __future__ import annotations

import time
from typing import Generic, NamedTuple, TypeVar

from engine.grammar_jobs import CompileJob

T = TypeVar("T")


class Settled(NamedTuple, Generic[T]):
    rid: str
    item: T                             # what the caller parked (its request)
    error: Exception | None             # None: compiled (or failed to: add_request says so)


class GrammarWaits(Generic[T]):
    def __init__(self) -> None:
        self._parked: dict[str, tuple[CompileJob, float, T]] = {}   # rid -> (job, parked at, item)

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, rid: str) -> bool:
        return rid in self._parked

    def park(self, rid: str, job: CompileJob, item: T) -> None:
        self._parked[rid] = (job, time.monotonic(), item)

    def drop(self, rid: str) -> T | None:
        parked = self._parked.pop(rid, None)
        return None if parked is None else parked[2]

    def clear(self) -> None:
        self._parked.clear()

    def settled(self) -> list[Settled[T]]:
        """The requests whose compile ended or whose wait is over, in the order they were parked."""
        out = []
        for rid, (job, parked_at, item) in list(self._parked.items()):
            error = None if job.done else job.expired(parked_at)
            if job.done or error is not None:
                del self._parked[rid]
                out.append(Settled(rid, item, error))
        return out
