"""Warnings about what peers send are rate-limited per (peer, reason): a flooding peer gets one
line per LOG_INTERVAL_S, the next says how many were suppressed, and the counts stay exact."""
import logging
from collections import Counter

from kvtransport.fake import ManualClock
from kvtransport.log_limiter import LOG_INTERVAL_S, MAX_KEYS, LogLimiter
from kvtransport.metrics import DropReason, ReceiverMetrics, SenderMetrics

log = logging.getLogger("kvtransport.test")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_one_line_a_key_an_interval_then_the_suppressed_count(caplog):
    """Per key: the first line, nothing for LOG_INTERVAL_S, then one line saying how many it held
    back; another key is limited on its own; beyond max_keys the least recent is forgotten."""
    caplog.set_level(logging.WARNING, logger="kvtransport.test")
    clock = ManualClock()
    limiter = LogLimiter(log, clock=clock, max_keys=2)
    assert [limiter.warning("a", "from %s", "a") for _ in range(5)] == [True] + [False] * 4
    assert limiter.warning("b", "from %s", "b")
    clock.advance(LOG_INTERVAL_S)
    assert limiter.warning("a", "from %s", "a") and limiter.warning("b", "from %s", "b")
    assert _lines(caplog) == ["from a", "from b", "from a (4 more suppressed)", "from b"]
    limiter.warning("c", "from c")                     # a third key: "a" (least recent) forgotten
    assert limiter.warning("a", "from a") and not limiter.warning("c", "from c")


def test_a_flood_of_drops_is_counted_exactly_and_logged_once_per_peer_and_reason(caplog):
    """1,000 bad MACs from one peer, one from another, one other reason from the first: three
    log lines, every drop counted, on either side's metrics."""
    caplog.set_level(logging.WARNING, logger="kvtransport")
    for metrics in (ReceiverMetrics(), SenderMetrics()):
        caplog.clear()
        for _ in range(1000):
            metrics.count_drop(DropReason.BAD_MAC, "p1", "tag")
        metrics.count_drop(DropReason.BAD_MAC, "p2", "tag")
        metrics.count_drop(DropReason.MALFORMED, "p1", "3 frames")
        assert metrics.drops == Counter({DropReason.BAD_MAC: 1001, DropReason.MALFORMED: 1})
        assert metrics.counters().frames_dropped == 1002
        assert len(_lines(caplog)) == 3 and all(line.startswith("dropped frame from p") for line in _lines(caplog))


def test_past_1024_keys_the_least_recently_logged_is_forgotten_and_the_rest_stay_limited(caplog):
    """By default the limiter remembers MAX_KEYS (1,024) keys: one peer more forgets the one that
    logged first (it logs again), every other is still held back within its interval."""
    caplog.set_level(logging.WARNING, logger="kvtransport.test")
    limiter = LogLimiter(log, clock=ManualClock())
    assert MAX_KEYS == 1024
    assert all(limiter.warning(("p%d" % k, "bad_mac"), "from p%d", k) for k in range(MAX_KEYS + 1))
    assert not any(limiter.warning(("p%d" % k, "bad_mac"), "from p%d", k) for k in range(1, MAX_KEYS + 1))
    assert limiter.warning(("p0", "bad_mac"), "from p0")        # forgotten: logs at once
    assert len(_lines(caplog)) == MAX_KEYS + 2
