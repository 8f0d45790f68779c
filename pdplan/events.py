"""The discrete-event clock: callbacks run in time order (ties in the order they were scheduled)."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run `fn` at time `t` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), fn))

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.now + dt, fn)

    @property
    def pending(self) -> int:
        """Events scheduled and not yet run."""
        return len(self._heap)

    def run(self, until: float = float("inf")) -> None:
        """Run events until none are left or the next one is past `until`."""
        while self._heap and self._heap[0][0] <= until:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()
