"""A hostile local process for the ZMTP tests: connects to an endpoint without the cluster secret
and queues big multipart messages for it (each frame under the receiver's MAXMSGSIZE).

    python -m tests.zmtp_flood ENDPOINT PASSWORD ROUNDS FRAMES FRAME_BYTES

PASSWORD "-" connects with no security mechanism (NULL), anything else with PLAIN as user
pdserve. Prints "sent" once every message is queued, then holds its sockets until stdin closes.

    python -m tests.zmtp_flood --bare-router MAXMSGSIZE

binds a ROUTER with no security mechanism to a random loopback port, prints its endpoint, and
holds it (reading nothing) until stdin closes: the control, measured in a process of its own.
"""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import zmq

from kvtransport.zmtp_auth import USERNAME

MIB = 1 << 20


def main(endpoint: str, password: str, rounds: int, frames: int, frame_bytes: int) -> None:
    ctx = zmq.Context()
    payload = bytes(frame_bytes)                 # one buffer, sent zero-copy: this process stays small
    socks = []
    for _ in range(rounds):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        if password != "-":
            sock.plain_username, sock.plain_password = USERNAME.encode(), password.encode()
        sock.connect(endpoint)
        _send(sock, [payload] * frames, 2.0 if password != "-" else 60.0)   # NULL: the control, always taken
        socks.append(sock)
    print("sent", flush=True)
    sys.stdin.read()
    ctx.destroy(linger=0)


def _send(sock: zmq.Socket, frames: list[bytes], patience_s: float = 2.0) -> None:
    """Queue frames if the socket takes them within patience_s (a refused connection may leave
    it with no pipe to queue on for a while: then the attempt was the point)."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            return sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            time.sleep(0.01)


@contextmanager
def flood(endpoint: str, password: str | None, rounds: int = 4, frames: int = 64,
          frame_bytes: int = MIB) -> Iterator[None]:
    """Runs the flood in a child process while the block runs (password None: no mechanism)."""
    with _child(endpoint, password or "-", str(rounds), str(frames), str(frame_bytes)) as child:
        assert child.stdout.readline().strip() == "sent"
        yield


def rss(pid: int | str = "self") -> int:
    """A process's resident memory, in bytes (this one's by default)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def hold_bare_router(max_msg_size: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    sys.stdin.read()
    ctx.destroy(linger=0)


@contextmanager
def bare_router(max_msg_size: int) -> Iterator[tuple[str, int]]:
    """An unauthenticated ROUTER in a child process of its own, so that its growth is measured
    alone (the test process's heap frees what earlier tests left at moments of its own choosing);
    yields (endpoint, pid)."""
    with _child("--bare-router", str(max_msg_size)) as child:
        yield child.stdout.readline().strip(), child.pid


@contextmanager
def _child(*args: str) -> Iterator[subprocess.Popen]:
    """This module run as a child with args; it ends when its stdin closes (killed after 30 s)."""
    child = subprocess.Popen([sys.executable, "-m", "tests.zmtp_flood", *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        yield child
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--bare-router":
        hold_bare_router(int(sys.argv[2]))
    else:
        main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
