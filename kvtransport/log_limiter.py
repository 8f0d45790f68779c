"""Warnings about what peers send, rate-limited per key (peer, reason): a flooding peer cannot
flood the log. The counts stay exact where they are kept (the metrics); the log says one line a
key per LOG_INTERVAL_S at most, and the next line that gets through says how many were suppressed
since the last one.

    t=0.0  dropped frame from p1: bad_mac ...          (logged)
    t=0.1  dropped frame from p1: bad_mac ...          (suppressed: 1)
    t=0.2  dropped frame from p2: bad_mac ...          (logged: another peer)
    t=12   dropped frame from p1: bad_mac ... (1 more suppressed)
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Hashable

LOG_INTERVAL_S = 10.0   # one line a key in this long at most
MAX_KEYS = 1024         # keys remembered (least recently logged forgotten first, with their suppressed count)


class LogLimiter:
    """Logs to logger at most once a key every interval_s seconds of clock. Not thread-safe."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self._log, self._interval_s, self._clock, self._max_keys = logger, interval_s, clock, max_keys
        self._keys: OrderedDict[Hashable, list] = OrderedDict()    # key -> [when it may log again, suppressed]

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        """Log msg % args at WARNING unless key logged less than interval_s ago; whether it did."""
        return self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        now = self._clock()
        entry = self._keys.get(key)
        if entry is not None and now < entry[0]:
            entry[1] += 1
            return False
        suppressed = entry[1] if entry is not None else 0
        self._keys[key] = [now + self._interval_s, 0]
        self._keys.move_to_end(key)
        if len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        if suppressed:
            msg, args = msg + " (%d more suppressed)", (*args, suppressed)
        self._log.log(level, msg, *args)
        return True
