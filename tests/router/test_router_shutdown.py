"""Bounded shutdown (issue #22): SIGTERM stops accepting at once, gives open streams
shutdown_grace_s, then ends them with an OpenAI-shaped error event and exits; a second signal
exits at once. Against a real router process (tests/http_server.py)."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.router_process import RouterProcess, http_request, read_until, read_until_closed

SLOW = ("--steps", "4000", "--interval-s", "0.05", "--stream-stall-timeout-s", "600")
STREAM = {"prompt": "hi", "max_tokens": 4000, "stream": True}


def _open_stream(router: RouterProcess):
    """A socket on which a long stream has begun."""
    sock = router.connect()
    sock.sendall(http_request("/v1/completions", STREAM))
    assert b"data: " in read_until(sock, b"data: ")
    return sock


def _exit_within(router: RouterProcess, timeout_s: float) -> float:
    """Seconds until the process exits; fails past timeout_s."""
    start = time.monotonic()
    router.process.wait(timeout_s)
    return time.monotonic() - start


def test_sigterm_ends_a_reading_stream_with_an_error_event_after_the_grace():
    """A stream still running when the grace ends gets a 503-shaped error event and [DONE]."""
    with RouterProcess(*SLOW, "--shutdown-grace-s", "1") as router:
        sock = _open_stream(router)
        router.signal(signal.SIGTERM)
        events = read_until_closed(sock, 15).split(b"\n\n")
        error = json.loads(events[-3].split(b"data: ", 1)[1])["error"]
        assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
        assert events[-2].endswith(b"data: [DONE]")
        assert _exit_within(router, 10) < 10


def test_sigterm_stops_accepting_at_once():
    """After SIGTERM no new connection is accepted, while the open stream goes on."""
    with RouterProcess(*SLOW, "--shutdown-grace-s", "5") as router:
        sock = _open_stream(router)
        router.signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(ConnectionRefusedError):
            router.connect()
        assert b"data: " in read_until(sock, b"data: ")
        sock.close()


def test_sigterm_with_a_stalled_stream_exits_after_grace():
    """A client that reads nothing cannot hold shutdown past the grace period (+ 2 s to cancel)."""
    with RouterProcess(*SLOW, "--shutdown-grace-s", "1") as router:
        sock = router.connect(rcvbuf=4096)
        sock.sendall(http_request("/v1/completions", {**STREAM, "n": 64}))
        time.sleep(2)
        router.signal(signal.SIGTERM)
        assert _exit_within(router, 15) < 8
        sock.close()


def test_a_second_signal_exits_at_once():
    """SIGTERM then SIGTERM (or SIGINT): out without waiting for the 30 s grace."""
    for second in (signal.SIGTERM, signal.SIGINT):
        with RouterProcess(*SLOW) as router:
            sock = _open_stream(router)
            router.signal(signal.SIGTERM)
            time.sleep(0.5)
            router.signal(second)
            assert _exit_within(router, 10) < 5
            sock.close()
