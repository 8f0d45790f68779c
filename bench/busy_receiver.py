"""A transfer to a decode node whose loop is busy: the receiver polls with poll(0) every 30 ms.

    .venv/bin/python bench/busy_receiver.py [--runs 3] [--no-split-payloads]

A ZmqSender's thread sends 1024 blocks of 64 KiB with send_blocks (or 4 layer groups x 512 blocks
with send_layers), then commits; this process polls the ZmqReceiver with poll(0) every 30 ms.
Prints, per run, the seconds from the first send to TransferCommitted, and the seconds the sender
spent inside send_blocks / send_layers (where a prefill node's loop, or its forward's layer hook,
waits while the queues are full). bench/README.md, twelfth session (xfer6): "Review fixes".
"""
from __future__ import annotations

import argparse
import threading
import time

from kvtransport.events import TransferCommitted
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender

GEOM = dict(num_blocks=1024, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)   # 64 KiB blocks
POLL_EVERY_S = 0.03


def run(form: str, split: bool) -> tuple[float | None, float]:
    """(seconds to commit or None after 30 s, seconds inside the sends) of one transfer."""
    src, dst = make_pool(seed=1, **GEOM), make_pool(seed=2, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, split_payloads=split)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET)
    pairing = threading.Thread(target=lambda: send.connect(recv.endpoint, 5.0))
    pairing.start()
    while pairing.is_alive():
        recv.poll(0.02)
    n = 1024 if form == "blocks" else 512
    ids = list(range(n))
    recv.register(Reservation("x1", tuple(ids)))
    send.begin("x1", recv.endpoint)
    inside: list[float] = []

    def ship() -> None:
        start = time.perf_counter()
        if form == "blocks":
            send.send_blocks("x1", ids, ids, src, ids)
        else:
            for group in range(4):
                send.send_layers("x1", ids, ids, src, ids, group, 1)
        inside.append(time.perf_counter() - start)
        send.commit("x1", 7, n * GEOM["block_size"])

    start, done = time.perf_counter(), None
    shipper = threading.Thread(target=ship)
    shipper.start()
    while done is None and time.perf_counter() - start < 30:
        if any(isinstance(e, TransferCommitted) for e in recv.poll(0)):
            done = time.perf_counter() - start
        time.sleep(POLL_EVERY_S)
    shipper.join()
    send.close()
    recv.close()
    return done, inside[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--split-payloads", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    for form in ("blocks", "layer slices"):
        runs = [run(form, args.split_payloads) for _ in range(args.runs)]
        print(f"{form}: s to commit {[None if a is None else round(a, 2) for a, _ in runs]}, "
              f"s inside the sends {[round(b, 2) for _, b in runs]}")


if __name__ == "__main__":
    main()
