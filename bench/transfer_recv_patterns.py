"""Raw pyzmq receive patterns for 2 MiB blocks, paired per repetition: what brings a receiver of
multipart messages (header, blocks, trailer) closer to one bare block per message?

    .venv/bin/python bench/transfer_recv_patterns.py [--repeats 8] [--block-mib 2] [--blocks 64]

Each pattern has its own receiving process (a zeroed, preallocated pool; a ROUTER, RCVHWM 16)
and this process sends every block zero-copy through a DEALER. Patterns:

  frames/N   [header, N blocks, trailer] per message, received copy=False, each block then copied
             into the pool by one slice assignment (pdserve's ZmqReceiveLink + InlineSink)
  into/N     the same messages, each block received with recv_into straight into its pool slot
             (pdserve's receiver since the tenth session)
  tiny/N     into/N with a header and trailer of 30 bytes: frames of at most 33 bytes are held
             inside libzmq's message (VSM); longer small frames point into libzmq's shared 8 KiB
             receive buffer, which a queued message then pins, so libzmq mallocs a new one
  raw/1      one bare block per message, copy=False, one copy (transfer_ceiling.py's pattern
             before the tenth session)
  bare/1     one bare block per message, recv_into its slot (transfer_ceiling.py's pattern since)

No headers are parsed and no MAC is checked: the patterns differ only in how the bytes move.
Prints GB/s, the receiver's Python-thread CPU and minor page faults per block (medians) and each
pattern's time against raw/1's in the same repetition (min / median / max).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

import torch
import zmq

HWM = 16
HEADER, TRAILER = b"h" * 100, b"t" * 40


def receiver(conn, pattern: str, per: int, nbytes: int, n: int) -> None:
    torch.set_num_threads(1)
    pool = memoryview(torch.zeros(n * nbytes, dtype=torch.uint8).numpy())
    slots = [pool[b * nbytes:(b + 1) * nbytes] for b in range(n)]
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while conn.recv():
        conn.send("ready")
        main, faults = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        got = 0
        while got < n:
            if pattern == "bare":
                sock.recv()
                sock.recv_into(slots[got])
            elif pattern in ("into", "tiny"):
                sock.recv(), sock.recv()                   # routing id, header
                for k in range(per):
                    sock.recv_into(slots[got + k])
                sock.recv()                                # trailer
            else:
                frames = sock.recv_multipart(copy=False)
                for k, f in enumerate(frames[1:] if pattern == "raw" else frames[2:-1]):
                    slots[got + k][:] = f.buffer
            got += per
        conn.send((time.thread_time() - main, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    sock.close()
    ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--patterns", default="frames/8,into/8,tiny/8,into/1,tiny/1,raw/1,bare/1")
    args = ap.parse_args()
    nbytes, n = int(args.block_mib * 2**20), args.blocks
    src = torch.randint(0, 255, (n * nbytes,), dtype=torch.uint8)
    blocks = [memoryview(src[b * nbytes:(b + 1) * nbytes].numpy()) for b in range(n)]
    ctx, sides = zmq.Context(io_threads=1), {}
    for name in args.patterns.split(","):
        pattern, per = name.split("/")
        assert n % int(per) == 0, "--blocks must be a multiple of every pattern's blocks per message"
        conn, child = mp.Pipe()
        proc = mp.get_context("spawn").Process(target=receiver, args=(child, pattern, int(per), nbytes, n))
        proc.start()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(conn.recv())
        sides[name] = (conn, proc, sock, pattern, int(per))
    got: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sides}
    for rep in range(args.repeats + 1):                  # repetition 0 warms up
        for name, (conn, _, sock, pattern, per) in sides.items():
            conn.send(True)
            conn.recv()
            start = time.perf_counter()
            for k in range(0, n, per):
                if pattern in ("raw", "bare"):
                    sock.send(blocks[k], copy=False)
                elif pattern == "tiny":
                    sock.send_multipart([HEADER[:30], *blocks[k:k + per], TRAILER[:30]], copy=False)
                else:
                    sock.send_multipart([HEADER, *blocks[k:k + per], TRAILER], copy=False)
            main, faults = conn.recv()
            if rep:
                got[name].append((time.perf_counter() - start, main, faults))
    for conn, proc, sock, *_ in sides.values():
        conn.send(False)
        proc.join(timeout=10)
        sock.close()
    ctx.term()
    base = got.get("raw/1")
    for name, runs in got.items():
        wall = statistics.median(r[0] for r in runs)
        line = (f"{name:9s} {n * nbytes / wall / 1e9:5.2f} GB/s, Python thread "
                f"{statistics.median(r[1] for r in runs) / n * 1e6:5.0f} us/block, "
                f"{statistics.median(r[2] for r in runs) / n:4.0f} faults/block")
        if base is not None:
            ratios = [b[0] / r[0] for r, b in zip(runs, base)]
            line += f"; raw/1 time / this {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(line)


if __name__ == "__main__":
    main()
