"""A hostile local process for the ZMTP tests: connects to an endpoint without the cluster secret
and queues big multipart messages for it (each frame under the receiver's MAXMSGSIZE).

    python -m tests.zmtp_flood ENDPOINT PASSWORD ROUNDS FRAMES FRAME_BYTES

PASSWORD "-" connects with no security mechanism (NULL), anything else with PLAIN as user
pdserve. Prints "sent" once every message is queued, then holds its sockets until stdin closes.
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
    argv = [sys.executable, "-m", "tests.zmtp_flood", endpoint, password or "-", str(rounds),
            str(frames), str(frame_bytes)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "sent"
        yield
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def rss() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
