"""What ZeroMQ's CURVE (encryption and a MAC over every byte) would cost the KV path here.

    .venv/bin/python bench/curve_cost.py [--seconds 4] [--rounds 2]

Loopback DEALER -> ROUTER, one I/O thread each side as a node has, messages of 16 MiB (a header
frame and four 4 MiB payload frames, the nodes' default --kv-batch-mib), sent as fast as the
receiver takes them: GB/s with the NULL mechanism (what pdserve's PLAIN gate costs once the
connection is up) and with CURVE, alternating, in one run. The KV path authenticates headers
and payload lengths in its own session, not payload bytes (README, "security"); this is the
figure behind that choice. Writes bench/results/curve_cost_<time>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first

import zmq  # noqa: E402

from bench.machine import write_result  # noqa: E402

MESSAGE_BYTES, FRAMES = 16 << 20, 4


def _curve(router: zmq.Socket, dealer: zmq.Socket) -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    router.curve_server, router.curve_secretkey, router.curve_publickey = True, server_secret, server_public
    dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_public, client_public, client_secret


def throughput(curve: bool, seconds: float) -> float:
    """GB/s received over `seconds` after one message of warm-up."""
    ctx = zmq.Context(io_threads=1)
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    if curve:
        _curve(router, dealer)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.RCVHWM, 4)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = [bytearray(MESSAGE_BYTES // FRAMES) for _ in range(FRAMES)]
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            try:
                if dealer.poll(100, zmq.POLLOUT):
                    dealer.send_multipart([b"h", *payload], copy=False)
            except zmq.ZMQError:
                return
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    router.recv_multipart(copy=False)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        router.recv_multipart(copy=False)
        count += 1
    gbps = count * MESSAGE_BYTES / (time.perf_counter() - start) / 1e9
    stop.set()
    sender.join(5)
    router.close()
    dealer.close()
    ctx.term()
    return gbps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="NULL/CURVE pairs, alternating")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"null": [], "curve": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(throughput(mode == "curve", args.seconds))
            print(f"{mode:5s} {runs[mode][-1]:.2f} GB/s", flush=True)
    null, curve = statistics.median(runs["null"]), statistics.median(runs["curve"])
    print(f"median: NULL {null:.2f} GB/s, CURVE {curve:.2f} GB/s, CURVE / NULL {curve / null:.2f}")
    print("wrote", write_result("curve_cost", {"message_bytes": MESSAGE_BYTES, "frames": FRAMES,
                                               "seconds": args.seconds, "runs_gbps": runs,
                                               "median_null_gbps": null, "median_curve_gbps": curve}))


if __name__ == "__main__":
    main()
