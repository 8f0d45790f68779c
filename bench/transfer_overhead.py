"""pdserve's per-block software overhead on each side of a transfer, without the socket.

    .venv/bin/python bench/transfer_overhead.py [--block-sizes 16,32,64] [--blocks 256] [--batch-mib 2]

CPU time (time.process_time, so load on the other core counts less than in wall time) per block:

  send   header (BlockBatch / BlockFrame), validation, encode, MAC, zero-copy payload views and
         zmq frames (one tracked per call, or one per block unbatched), against the ceiling's one
         zero-copy zmq frame per block; messages go to a connected PUSH socket nobody reads
         (never blocking: SNDHWM 0), so libzmq's own copying is not in it
  recv   ReceiverCore.handle on pre-sealed messages (MAC, decode, checks, ledger, the copy into
         the pool, the Commit), against the ceiling's one copy per block from the same buffers;
         "landed": the path the ZMQ link takes for batches since the tenth session (landing()
         from the header and seal, each payload copied into its slot as recv_into would, landed());
         and the same handle with the sink's copy left out ("no copy": the software overhead on
         its own, which memory bandwidth taken by other processes does not blur: a copy of
         70-300 us a block swings by more than the overhead between two runs on a loaded machine);
         "split": the same with a batch's payloads as messages of their own (owed(), each into
         its slot, landed() after the last), as the ZMQ link takes them since the twelfth session

BlockBatch messages carry up to --batch-mib MiB (the nodes' --kv-batch-mib).

Writes bench/results/transfer_overhead_<time>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first

import torch  # noqa: E402
import zmq  # noqa: E402

from bench.machine import write_result  # noqa: E402
from kvtransport.framing import Framer  # noqa: E402
from kvtransport.payload import InlineSink, pool_bytes  # noqa: E402
from kvtransport.receiver_core import ReceiverCore  # noqa: E402
from kvtransport.receiver_state import Reservation  # noqa: E402
from kvtransport.sender_core import SenderCore  # noqa: E402
from kvtransport.payload_channel import InlineChannel  # noqa: E402
from kvtransport.session import Session  # noqa: E402
from kvtransport.testing import make_identity, make_pool  # noqa: E402
from pdwire.messages import BATCH_BYTES, Commit, Hello, batch_blocks  # noqa: E402

LAYOUT = dict(num_layers=8, num_kv_heads=8, head_dim=64, dtype=torch.float32)
SECRET = b"transfer-overhead-secret-0123456"
NONCES = (b"i" * 16, b"r" * 16)


def cpu_us(makers: dict, n: int, repeats: int = 7) -> dict[str, float]:
    """Median CPU microseconds per block of each makers[name]()() (a run over n blocks; the maker's
    own work is not timed), the variants alternating within each repetition."""
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(repeats):
        for name, make in makers.items():
            fn = make()
            start = time.process_time()
            fn()
            times[name].append((time.process_time() - start) / n * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def sender_paths(src: torch.Tensor, n: int, sock: zmq.Socket, batch_bytes: int) -> dict[str, float]:
    core = SenderCore(make_identity(src, "p"), SECRET)
    links = {split: type("L", (), {"session": Session(SECRET, *NONCES, True), "sealed_first": True, "split": split})()
             for split in (False, True)}                                                # paired, either form
    core._links["e"] = links[False]
    core.begin("x", "e")
    channel, ids = InlineChannel(), list(range(n))
    step = batch_blocks(src[0].numel() * src.element_size(), batch_bytes)

    def batched(split: bool = False):
        core._links["e"] = links[split]
        for k in range(0, n, step):
            frames = core.pack("e", core.batch_header("x", ids[k:k + step], ids[k:k + step], src),
                               *channel.inline_many(src, ids[k:k + step]))
            *head, payload = frames                     # [header, seal, *payloads]
            tracked = zmq.Frame(payload, copy=False, track=k + step >= n)
            if not split:
                sock.send_multipart([*head, tracked], copy=False)
                continue
            sock.send_multipart(head[:2], copy=False)     # then a message per payload
            for p in head[2:]:
                sock.send(p, copy=False)
            sock.send(tracked, copy=False)

    def unbatched():
        for b in ids:
            header, seal, payload = core.pack("e", core.block_header("x", b, b, src), channel.inline(src, b))
            sock.send_multipart([header, seal, zmq.Frame(payload, copy=False, track=True)], copy=False)

    pool = pool_bytes(src)
    nbytes = len(pool) // n

    def ceiling():
        for b in ids:
            sock.send(pool[b * nbytes:(b + 1) * nbytes], copy=False)

    return cpu_us({"ceiling": lambda: ceiling, "batched": lambda: batched, "unbatched": lambda: unbatched,
                   "split": lambda: lambda: batched(split=True)}, n)


class NoCopySink(InlineSink):
    """InlineSink without its copy: what is left of the receive path is software overhead."""

    def write_many(self, dsts: list[int], payloads: list[memoryview], first_layer: int = 0) -> None:
        pass


def paired_core(src: torch.Tensor, n: int, batch_bytes: int) -> tuple[ReceiverCore, torch.Tensor]:
    """A ReceiverCore over a fresh pool of n blocks shaped as src's (an InlineSink; split payloads, as
    a ZmqReceiver's: it takes batch_bytes either way), paired with the peer "p" whose messages
    Batches seals: (the core, its pool)."""
    dst = make_pool(num_blocks=n, block_size=src.shape[3], seed=None, **LAYOUT)
    ident = make_identity(dst, "d")
    core = ReceiverCore(n, ident, SECRET, InlineSink(dst, ident.layout), lambda peer, frames: None,
                        max_batch_bytes=batch_bytes, split_payloads=True)
    core._auth._sessions["p"] = Session(SECRET, *NONCES, False)
    core._dispatch("p", Hello(make_identity(src, "p")), ())
    return core, dst


class Batches:
    """The sealed messages the peer "p" sends to paired_core's receiver: src's n blocks, in batches of
    batch_bytes (each [header, seal, payloads...], the payloads zero-copy views of src)."""

    def __init__(self, src: torch.Tensor, n: int, batch_bytes: int) -> None:
        self.src, self.ids, self.pool = src, list(range(n)), pool_bytes(src)
        self.nbytes = len(self.pool) // n
        self.step = batch_blocks(self.nbytes, batch_bytes)
        self.session, self.framer = Session(SECRET, *NONCES, True), Framer()
        self.sender = SenderCore(make_identity(src, "p"), SECRET)

    def views(self) -> list[memoryview]:
        return [self.pool[b * self.nbytes:(b + 1) * self.nbytes] for b in self.ids]

    def sealed(self, xfer: str, split: bool) -> list[list]:
        ids, step, views = self.ids, self.step, self.views()
        headers = [self.sender.batch_header(xfer, ids[k:k + step], ids[k:k + step], self.src)
                   for k in range(0, len(ids), step)]
        return [self.framer.pack_many(self.session, header, views[k * step:(k + 1) * step], sealed_first=True,
                                      split=split) for k, header in enumerate(headers)]


def receiver_paths(src: torch.Tensor, n: int, batch_bytes: int) -> dict[str, float]:
    core, dst = paired_core(src, n, batch_bytes)
    sinks = {True: core._sink, False: NoCopySink(dst, core.identity.layout)}
    batches = Batches(src, n, batch_bytes)
    session, framer, sender, ids, pool, nbytes = (batches.session, batches.framer, batches.sender, batches.ids,
                                                   batches.pool, batches.nbytes)
    rounds = iter(range(1 << 20))

    def sealed(batch: bool, split: bool = False) -> list[list]:
        xfer = f"x{next(rounds)}"
        core.register(Reservation(xfer, tuple(ids)))
        views = batches.views()
        if batch:
            msgs = batches.sealed(xfer, split)
        else:
            msgs = [framer.pack_many(session, sender.block_header(xfer, b, b, src), [views[b]], sealed_first=True)
                    for b in ids]
        return msgs + [framer.pack(session, Commit(xfer, 1, n * src.shape[3]))]

    def handle(batch: bool, copy: bool = True):
        msgs = sealed(batch)
        core._sink = sinks[copy]
        return lambda: [core.handle("p", [memoryview(f) for f in frames]) for frames in msgs]

    def land(copy: bool = True, split: bool = False):
        """As ZmqReceiveLink does with a Lander: landing() from the header and seal, each payload
        into its slot (recv_into's one copy, here a slice assignment from the same buffers), landed();
        split: each payload after the link has asked owed(), its size noted, landed() after the last."""
        msgs = sealed(True, split)
        core._sink = sinks[True]

        def run():
            for header, seal, *payloads in msgs:
                landing = core.landing("p", memoryview(header), memoryview(seal), split) if payloads else None
                if landing is None:
                    core.handle("p", [memoryview(header), memoryview(seal), *payloads])
                    continue
                for slot, payload in zip(landing.slots, payloads):
                    if split and core.owed("p") is not landing:
                        raise RuntimeError("a split batch not owed")
                    if copy:
                        slot[:] = payload
                    landing.sizes.append(len(payload))
                core.landed("p", landing, landing.sizes, 0.0)
        return run

    flat = pool_bytes(dst)

    def ceiling():
        for b in ids:
            flat[b * nbytes:(b + 1) * nbytes] = pool[b * nbytes:(b + 1) * nbytes]
    out = cpu_us({"ceiling": lambda: ceiling, "batched": lambda: handle(True), "unbatched": lambda: handle(False),
                  "batched_no_copy": lambda: handle(True, copy=False),
                  "unbatched_no_copy": lambda: handle(False, copy=False),
                  "landed": lambda: land(), "landed_no_copy": lambda: land(copy=False),
                  "split": lambda: land(split=True), "split_no_copy": lambda: land(copy=False, split=True)}, n)
    assert core.metrics.frames_dropped == 0 and core.metrics.transfers_committed == 7 * 8, core.metrics
    return out


def copy_us(nbytes: int = 2 << 20, frames: int = 48) -> tuple[float, float]:
    """Median wall us of one nbytes copy into a pool from a source written just before (in cache,
    as a frame copied as it lands) and from one written frames / 2 frames earlier (from DRAM, as a
    frame that waited in the socket's queue)."""
    pool, bufs = bytearray(64 * nbytes), [bytearray(nbytes) for _ in range(frames)]
    pv = memoryview(pool)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for hot in (True, False):
            for k in range(frames):
                bufs[k if hot else (k + frames // 2) % frames][:] = bytes([k & 255]) * nbytes
                start = time.perf_counter()
                pv[(k % 64) * nbytes:(k % 64 + 1) * nbytes] = bufs[k]
                times[hot].append((time.perf_counter() - start) * 1e6)
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-sizes", default="16,32,64")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--batch-mib", type=int, default=BATCH_BYTES >> 20, help="payload MiB of one BlockBatch")
    args = ap.parse_args()
    ctx = zmq.Context()
    sink, sock = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    sink.bind("inproc://overhead")
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect("inproc://overhead")
    rows = []
    for bs in map(int, args.block_sizes.split(",")):
        src = make_pool(num_blocks=args.blocks, block_size=bs, seed=0, **LAYOUT)
        row = {"block_size": bs, "block_mib": src[0].numel() * 4 / 2**20,
               "send": sender_paths(src, args.blocks, sock, args.batch_mib << 20),
               "recv": receiver_paths(src, args.blocks, args.batch_mib << 20)}
        while sink.poll(0):
            sink.recv_multipart(copy=False)
        rows.append(row)
        for side in ("send", "recv"):
            c = row[side]["ceiling"]
            print(f"block {bs} tok ({row['block_mib']:.1f} MiB) {side}: ceiling {c:6.1f} us/block CPU; "
                  f"overhead batched {row[side]['batched'] - c:+6.1f}, unbatched {row[side]['unbatched'] - c:+6.1f}, "
                  f"split {row[side]['split'] - c:+6.1f}"
                  + (f", landed {row[side]['landed'] - c:+6.1f}; no copy: batched {row[side]['batched_no_copy']:5.1f}, "
                     f"unbatched {row[side]['unbatched_no_copy']:5.1f}, landed {row[side]['landed_no_copy']:5.1f}, "
                     f"split {row[side]['split_no_copy']:5.1f}" if side == "recv" else ""))
    sock.close(linger=0)
    sink.close(linger=0)
    ctx.term()
    hot, cold = copy_us()
    print(f"a 2 MiB copy into the pool: {hot:.0f} us from a source just written, {cold:.0f} us from one written "
          f"48 MiB earlier")
    print("wrote", write_result("transfer_overhead", {"blocks": args.blocks, "batch_mib": args.batch_mib,
                                                      "load_avg": os.getloadavg(), "rows": rows,
                                                      "copy_2mib_us": {"hot": hot, "cold": cold}}))


if __name__ == "__main__":
    main()
