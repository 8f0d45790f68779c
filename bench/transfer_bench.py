"""KV block transfer throughput over the ZMQ backend, prefill process -> decode process.

    .venv/bin/python bench/transfer_bench.py [--tokens 8192] [--repeats 5] [--quick]

Layout: the 58.5M Llama (8 layers, 8 KV heads, head_dim 64, fp32), block sizes 16/32/64
tokens (0.5/1/2 MiB per block). The decode side runs in its own process with a ZmqReceiver;
this process reserves blocks there, ships a `--tokens` prompt block by block and stops the
clock when the receiver reports the transfer committed (end to end: header, zero-copy send,
socket, copy into the reserved blocks, commit). Rows: TCP, IPC. Every connection is
authenticated (kvtransport.session); the cost of sealing and opening one block's header is
measured in the same run and printed beside the per-block transfer time it adds to.
Prints machine info and writes bench/results/transfer_bench.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import zmq

from kvtransport.events import TransferCommitted
from kvtransport.framing import Framer
from pdwire.messages import BlockFrame
from kvtransport.receiver_state import Reservation
from kvtransport.session import Session
from kvtransport.testing import make_identity, make_pool
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender

LAYOUT = dict(num_layers=8, num_kv_heads=8, head_dim=64, dtype=torch.float32)
SECRET = b"transfer-bench-secret-0123456789"
RESULTS = Path(__file__).resolve().parent / "results" / "transfer_bench.json"


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "platform": platform.platform()}


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    """Single-copy bandwidth of this machine, for scale."""
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    a.copy_(b)
    start = time.perf_counter()
    for _ in range(5):
        a.copy_(b)
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def mac_us_per_block(block_size: int, n: int = 20_000) -> float:
    """Microseconds to seal a block's header on the sender and open it on the receiver."""
    sender, receiver = Session(SECRET, b"i" * 16, b"r" * 16, True), Session(SECRET, b"i" * 16, b"r" * 16, False)
    framer = Framer()
    header = BlockFrame("0" * 32, 7, 1234, block_size << 15, "float32", (8, 2, block_size, 8, 64))
    payload = memoryview(bytearray(64))
    start = time.perf_counter()
    for _ in range(n):
        receiver.open(framer.pack(sender, header, payload))
    return (time.perf_counter() - start) / n * 1e6


def decode_process(conn, block_size: int, num_blocks: int, bind: str, secret) -> None:
    """Owns a pool and a ZmqReceiver: registers what it is told, reports committed transfers."""
    torch.set_num_threads(1)
    pool = make_pool(num_blocks=num_blocks, block_size=block_size, seed=None, **LAYOUT)
    recv = ZmqReceiver(pool, make_identity(pool, "bench-d", "zmq"), secret, bind, hwm=16)
    conn.send(recv.endpoint)
    while True:
        while conn.poll():
            cmd = conn.recv()
            if cmd is None:
                recv.close()
                return
            recv.register(Reservation(cmd, tuple(range(num_blocks))))
        for ev in recv.poll(0.001):
            ok = isinstance(ev, TransferCommitted)
            conn.send((ev.xfer_id, ev.nbytes, ev.transfer_seconds) if ok else ("failed", ev))


def run_case(block_size: int, tokens: int, repeats: int, bind: str, secret) -> dict:
    num_blocks = -(-tokens // block_size)
    src = make_pool(num_blocks=num_blocks, block_size=block_size, seed=0, **LAYOUT)
    conn, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=decode_process,
                                           args=(child, block_size, num_blocks, bind, secret))
    proc.start()
    endpoint = conn.recv()
    send = ZmqSender(make_identity(src, "bench-p", "zmq"), secret, hwm=16)
    send.connect(endpoint)
    walls, recv_secs = [], []
    for rep in range(repeats + 1):                      # repetition 0 warms up
        xfer_id = f"x{rep}"
        conn.send(xfer_id)
        time.sleep(0.05)                                # the reservation is in place
        send.begin(xfer_id, endpoint)
        start = time.perf_counter()
        for b in range(num_blocks):
            send.send_block(xfer_id, b, b, src, b)
        send.commit(xfer_id, 1, tokens)
        _, nbytes, recv_seconds = _reply(conn, proc)
        if rep:
            walls.append(time.perf_counter() - start)
            recv_secs.append(recv_seconds)
    conn.send(None)
    proc.join(timeout=10)
    send.close()
    wall = statistics.median(walls)
    return {"block_size": block_size, "block_mib": nbytes / num_blocks / 2**20,
            "blocks": num_blocks, "mib": nbytes / 2**20, "median_s": wall,
            "gbps": nbytes / wall / 1e9, "best_gbps": nbytes / min(walls) / 1e9,
            "recv_side_gbps": nbytes / statistics.median(recv_secs) / 1e9,
            "sender_send_s_per_block": send.metrics.send_seconds / send.metrics.blocks_sent,
            "us_per_block": wall / num_blocks * 1e6, "mac_us_per_block": mac_us_per_block(block_size)}


def _reply(conn, proc, timeout: float = 120.0):
    """The decode process's report of one transfer; raises if it failed or the process died."""
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"decode process gone or silent (exit code {proc.exitcode})")
    reply = conn.recv()
    if reply[0] == "failed":
        raise RuntimeError(f"transfer failed: {reply[1]}")
    return reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens per transfer")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1024 tokens, 2 repeats")
    ap.add_argument("--transports", default="tcp,ipc", help="rows to run, comma-separated")
    args = ap.parse_args()
    tokens, repeats = (1024, 2) if args.quick else (args.tokens, args.repeats)
    info = {**machine_info(), "memcpy_gbps": round(memcpy_gbps(), 2)}
    print(json.dumps(info, indent=1))
    rows = []
    ipc = f"ipc:///tmp/kvt-bench-{os.getpid()}.sock"
    cases = {"tcp": "tcp://127.0.0.1:*", "ipc": ipc}
    for name in args.transports.split(","):
        for block_size in (16, 32, 64):
            row = {"transport": name, **run_case(block_size, tokens, repeats, cases[name], SECRET)}
            rows.append(row)
            print(f"{name:9s} block {block_size:3d} tok ({row['block_mib']:.1f} MiB) x{row['blocks']:4d}: "
                  f"{row['gbps']:5.2f} GB/s end to end (best {row['best_gbps']:5.2f}), "
                  f"receiver {row['recv_side_gbps']:5.2f} GB/s, "
                  f"{row['median_s'] * 1e3:7.1f} ms per {row['mib']:.0f} MiB; MAC {row['mac_us_per_block']:.1f} us "
                  f"of {row['us_per_block']:.0f} us per block ({row['mac_us_per_block'] / row['us_per_block']:.1%})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": info, "tokens": tokens, "repeats": repeats, "rows": rows},
                                  indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
