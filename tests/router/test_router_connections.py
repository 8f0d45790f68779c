"""Connection hygiene at the HTTP edge (issue #22): silent, slow and stalled clients are cut; too
many connections get a 503. Against a real router process (tests/http_server.py) on loopback."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from router.config import RouterConfig
from tests.router_process import HANG_S, RouterProcess, closed_by_peer, http_request, read_until, wait_until

KEY = "key-of-16-or-more"
FLAGS = ("--header-timeout-s", "1", "--body-timeout-s", "1", "--stream-stall-timeout-s", "2",
         "--keep-alive-timeout-s", "1")


@pytest.fixture(scope="module")
def router():
    with RouterProcess(*FLAGS, "--steps", "400", "--interval-s", "0.02") as process:
        yield process


def _aborted(router: RouterProcess) -> float:
    status, body = router.request("/metrics")
    match = re.search(rb'pdserve_request_failure_total\{model_name="[^"]*",reason="abort"\} ([0-9.]+)', body)
    return float(match.group(1)) if match else 0.0


def test_a_silent_connection_is_closed(router):
    """A connection that sends nothing is closed once header_timeout_s passes."""
    sock = router.connect()
    assert closed_by_peer(sock, HANG_S)
    sock.close()


def test_headers_sent_a_byte_at_a_time_are_cut_off(router):
    """Slowloris: headers that never complete are cut at header_timeout_s, however they trickle:
    a byte every 0.1 s, which would take over 30 s to send them all, is cut (at 1 s) before."""
    sock = router.connect()
    with pytest.raises(OSError):
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 300:
            sock.send(bytes([byte]))
            time.sleep(0.1)
    sock.close()


def test_a_body_shorter_than_its_length_is_cut_off(router):
    """A Content-Length 5 bytes longer than the body sent: the connection closes at body_timeout_s."""
    sock = router.connect()
    data = http_request("/v1/completions", {"prompt": "hi"})
    sock.sendall(data.replace(b"Content-Length: 16", b"Content-Length: 21"))
    assert closed_by_peer(sock, HANG_S)
    sock.close()


def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(router):
    """n 128 streamed to a 4 KB receive buffer never read: cut after stream_stall_timeout_s, the
    request aborted (counted once), and router RSS stays within a few MB of where it was. Unread,
    the stream can end no other way: its writes wait on the client for good, and its ~0.8 MB of
    deltas stay under --max-stream-buffer-bytes."""
    before_rss, before_aborts = router.rss_mb(), _aborted(router)
    sock = router.connect(rcvbuf=4096)
    sock.sendall(http_request("/v1/completions", {"prompt": "hi", "n": 128, "max_tokens": 400, "stream": True}))
    wait_until(lambda: _aborted(router) > before_aborts, "the stalled stream's abort")
    assert _aborted(router) == before_aborts + 1
    assert router.rss_mb() - before_rss < 40
    assert closed_by_peer(sock, HANG_S)
    sock.close()


def test_slow_connections_give_their_slots_to_real_clients():
    """Slowloris: 515 connections that each send one byte and then nothing fill --max-connections
    (512), yet real clients are served: each new connection takes the slot of the one that has
    waited longest for its request, which is closed (they were refused with 503s before)."""
    with RouterProcess(*FLAGS[:2], "--header-timeout-s", "600") as router:
        slow = []
        for _ in range(515):
            slow.append(router.connect())
            slow[-1].sendall(b"G")
        assert closed_by_peer(slow[0], HANG_S) and closed_by_peer(slow[2], HANG_S)   # the last three took their slots
        for _ in range(3):      # the first takes slow[3]'s slot, and gives it back when done
            assert router.request("/health")[0] == 200
        assert closed_by_peer(slow[3], HANG_S)
        assert not closed_by_peer(slow[4], 0.2) and not closed_by_peer(slow[-1], 0.2)
        for s in slow:
            s.close()


def test_short_of_file_descriptors_the_router_serves_fewer_connections_and_never_runs_out():
    """A router process that may open 384 file descriptors, at the default --max-connections 512:
    it serves fewer connections and says so, and 600 clients that each send a byte and then nothing
    never take its last descriptors, so real clients are served and the process still opens files
    (/metrics reads /proc/self/fd). They took them: accept() failed with EMFILE, and every new
    connection was closed unanswered."""
    with RouterProcess(*FLAGS[:2], "--header-timeout-s", "600", nofile=384) as router:
        slow = []
        for _ in range(600):
            slow.append(router.connect())
            slow[-1].sendall(b"G")
        assert closed_by_peer(slow[0], HANG_S)
        for _ in range(3):
            assert router.request("/health")[0] == 200
        status, body = router.request("/metrics")
        assert status == 200
        open_fds = float(re.search(rb"^process_open_fds ([0-9.e+]+)$", body, re.MULTILINE).group(1))
        reserved = RouterConfig.reserved_fds
        assert open_fds <= 384 - reserved and len(os.listdir(f"/proc/{router.process.pid}/fd")) <= 384 - reserved
        for s in slow:
            s.close()
    assert "--max-connections 512 does not fit in the 384 file descriptors" in router.process.stderr.read()


def _running_stream(router: RouterProcess):
    """A connection whose streamed request runs (its 200 and first event read)."""
    sock = router.connect()
    sock.sendall(http_request("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 400}))
    assert read_until(sock, b"data: ", timeout_s=HANG_S).startswith(b"HTTP/1.1 200")
    return sock


def test_connections_over_the_limit_get_a_503_when_every_slot_runs_a_request():
    """When every one of --max-connections runs a request, a new connection is answered 503 in
    OpenAI's error shape and closed, not queued; past --max-refusals being refused at once, one is
    closed unanswered; the running requests go on."""
    with RouterProcess(*FLAGS[:2], "--max-connections", "4", "--max-refusals", "2", "--stream-stall-timeout-s", "30",
                       "--steps", "400", "--interval-s", "0.02") as router:
        running = [_running_stream(router) for _ in range(4)]
        refused = [router.connect() for _ in range(3)]
        for sock in refused[:2]:
            head, body = _read_all(sock).split(b"\r\n\r\n", 1)
            assert head.split(b"\r\n")[0] == b"HTTP/1.1 503 Service Unavailable"
            error = json.loads(body)["error"]
            assert error["type"] == "service_unavailable_error" and "--max-connections" in error["message"]
        try:
            assert _read_all(refused[2]) == b""
        except ConnectionResetError:
            pass
        assert b"data: " in running[3].recv(1 << 16)
        for s in running + refused:
            s.close()
        assert router.request("/health")[0] == 200


def _read_all(sock, until: bytes | None = None, timeout: float = HANG_S) -> bytes:
    """What sock receives until the peer closes (or `until` arrives), within timeout."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
        if until is not None and until in data:
            break
    return data


@pytest.mark.parametrize("flags, path, status", [
    (("--api-key", KEY), "/tokenize", b"401 Unauthorized"), (("--api-key", KEY), "/detokenize", b"401 Unauthorized"),
    (("--api-key", KEY), "/openapi.json", b"401 Unauthorized"),
    (("--admin-api-key", KEY), "/admin/nodes/d/drain", b"401 Unauthorized"),
    ((), "/admin/pools/decode", b"403 Forbidden")])
def test_keyed_routes_beyond_v1_refuse_from_the_headers(flags, path, status):
    """/tokenize, /detokenize, /openapi.json and /admin answer a request without their key (a 403 on
    a router with no admin key) from its headers, as /v1 does: an unauthenticated 8 MB body of 4,000-digit ints
    was read and parsed first, ~0.3 s of the event loop each (redteam)."""
    with RouterProcess(*FLAGS[:2], *flags) as router:
        sock = router.connect()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEY}x\r\nContent-Length: {8 << 20}\r\n\r\n".encode())
        head = read_until(sock, b"\r\n\r\n", timeout_s=HANG_S)
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 " + status
        sock.close()


def test_a_request_without_the_api_key_is_refused_before_its_body_is_read():
    """With --api-key, a /v1 request without the key gets its 401 from its headers alone: the router
    neither waits for nor parses its body (the finding: an 8 MB body was read and parsed, holding the
    event loop ~0.8 s, before the 401)."""
    with RouterProcess(*FLAGS[:2], "--api-key", KEY) as router:
        for key in ("", "Authorization: Bearer wrong\r\n"):
            sock = router.connect()
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{key}"
                         f"Content-Length: {8 << 20}\r\n\r\n".encode())
            head = read_until(sock, b"\r\n\r\n", timeout_s=HANG_S)
            assert head.split(b"\r\n")[0] == b"HTTP/1.1 401 Unauthorized"
            sock.close()
        assert router.request("/v1/models")[0] == 401
