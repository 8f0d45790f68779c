"""Starting and talking to a tests.http_server process: raw sockets, SSE reads, RSS."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.http_server import free_port

ROOT = Path(__file__).resolve().parent.parent
# Waits for a state of the router process only bound a hang: a starved 2-core CI machine may take
# many times what it takes here.
HANG_S = 60.0


class RouterProcess:
    """A started router process on a free loopback port; stop() ends it (SIGKILL after 10 s).
    nofile: the process's RLIMIT_NOFILE (soft and hard), when given."""

    def __init__(self, *flags: str, ready_timeout_s: float = 60.0, nofile: int | None = None):
        self.port = free_port()
        limit = None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.process = subprocess.Popen([sys.executable, "-m", "tests.http_server", "--port", str(self.port),
                                         *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
        deadline = time.monotonic() + ready_timeout_s
        while not self._answers():
            assert self.process.poll() is None, self.process.stderr.read()
            assert time.monotonic() < deadline, "the router process did not start"
            time.sleep(0.1)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.process.pid, sig)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(10)
        sock.connect(("127.0.0.1", self.port))
        return sock

    def request(self, path: str, body: dict | None = None, timeout_s: float = 30.0) -> tuple[int, bytes]:
        """One request on a fresh connection: (status, body)."""
        sock = self.connect()
        sock.settimeout(timeout_s)
        sock.sendall(http_request(path, body))
        data = read_until_closed(sock, timeout_s)
        sock.close()
        head, _, rest = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), rest

    def _answers(self) -> bool:
        try:
            return self.request("/health", timeout_s=2)[0] == 200
        except OSError:
            return False


def http_request(path: str, body: dict | None = None) -> bytes:
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def read_until(sock: socket.socket, marker: bytes, timeout_s: float = 10.0) -> bytes:
    """What arrives until `marker` has been seen (or the connection closes)."""
    data, deadline = b"", time.monotonic() + timeout_s
    while marker not in data and time.monotonic() < deadline:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def wait_until(condition, what: str, timeout_s: float = HANG_S) -> None:
    """Returns once condition() holds, checked every 50 ms; fails with `what` past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True if the server closes the connection within timeout_s (reading and dropping what comes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not sock.recv(1 << 16):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
    return False
