"""Bounded shutdown (issue #22): SIGTERM stops accepting at once, gives open streams
shutdown_grace_s, then ends them with an OpenAI-shaped error event and exits; a second signal
exits at once. Against a real router process (tests/http_server.py)."""
from __future__ import annotations

import json
import signal
import time

from tests.router_process import HANG_S, RouterProcess, http_request, read_until, read_until_closed, wait_until

SLOW = ("--steps", "4000", "--interval-s", "0.05", "--stream-stall-timeout-s", "600")   # a stream: 200 s at least
STREAM = {"prompt": "hi", "max_tokens": 4000, "stream": True}
LONG_GRACE = ("--shutdown-grace-s", "600")   # far past any wait here: what happens within it happened "at once"


def _open_stream(router: RouterProcess):
    """A socket on which a long stream has begun."""
    sock = router.connect()
    sock.sendall(http_request("/v1/completions", STREAM))
    assert b"data: " in read_until(sock, b"data: ", HANG_S)
    return sock


def _next_event(sock) -> dict:
    """The first whole SSE event to arrive after what sock holds now (which is read and dropped)."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
    except BlockingIOError:
        pass
    sock.settimeout(HANG_S)
    data = b""
    while data.count(b"\n\n") < 2:
        chunk = sock.recv(1 << 16)
        assert chunk, "the stream ended"
        data += chunk
    return json.loads(data.split(b"\n\n")[1].split(b"data: ", 1)[1])


def _refuses(router: RouterProcess) -> bool:
    """Whether a new connection is refused (one that is accepted is closed at once)."""
    try:
        router.connect().close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_ends_a_reading_stream_with_an_error_event_after_the_grace():
    """A stream still running when the grace ends gets a 503-shaped error event and [DONE]."""
    with RouterProcess(*SLOW, "--shutdown-grace-s", "1") as router:
        sock = _open_stream(router)
        router.signal(signal.SIGTERM)
        events = read_until_closed(sock, HANG_S).split(b"\n\n")
        error = json.loads(events[-3].split(b"data: ", 1)[1])["error"]
        assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
        assert events[-2].endswith(b"data: [DONE]")
        router.process.wait(HANG_S)


def test_sigterm_stops_accepting_at_once():
    """After SIGTERM no new connection is accepted, while the open stream goes on: within the
    grace period (600 s, past every wait here), its tokens still come, not the error event."""
    with RouterProcess(*SLOW, *LONG_GRACE) as router:
        sock = _open_stream(router)
        router.signal(signal.SIGTERM)
        wait_until(lambda: _refuses(router), "the listener to close")
        assert _next_event(sock)["choices"][0]["text"] == "abcdefgh"
        sock.close()


def test_sigterm_with_a_stalled_stream_exits_after_grace():
    """A client that reads nothing cannot hold shutdown past the grace period (+ 2 s to cancel):
    the process exits, where the stream would run 200 s and the stall timer 600 s."""
    with RouterProcess(*SLOW, "--shutdown-grace-s", "1") as router:
        sock = router.connect(rcvbuf=4096)
        sock.sendall(http_request("/v1/completions", {**STREAM, "n": 64}))
        time.sleep(2)       # the stream fills the socket's buffers (shutdown is bounded however far it got)
        router.signal(signal.SIGTERM)
        router.process.wait(HANG_S)
        sock.close()


def test_a_second_signal_exits_at_once():
    """SIGTERM then SIGTERM (or SIGINT): out without waiting for the grace (600 s here). The second
    is sent once the first has been handled (the listener closed): two pending SIGTERMs are one."""
    for second in (signal.SIGTERM, signal.SIGINT):
        with RouterProcess(*SLOW, *LONG_GRACE) as router:
            sock = _open_stream(router)
            router.signal(signal.SIGTERM)
            wait_until(lambda: _refuses(router), "the listener to close")
            router.signal(second)
            router.process.wait(HANG_S)
            sock.close()
