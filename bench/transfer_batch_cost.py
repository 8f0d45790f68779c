"""What one split batch's checks and bookkeeping cost the receiving thread, warm and cold.

    .venv/bin/python bench/transfer_batch_cost.py [--block-size 64] [--batch-mib 16,64,128] [--rounds 60]

For each batch size: a ReceiverCore (as a ZmqReceiver's, split payloads) takes sealed batches of
one transfer as the ZMQ link does: landing() from the header and seal, each payload copied into its
pool slot, landed() after the last. landing() and landed() are timed (perf_counter, medians over
the batches of the measured rounds): "after copies" right after the batch's own payload copies (as
on the wire), "cold" after a further 8 MiB copy that evicts what the copies left, "warm" with the
payload copies left out (the two calls back to back, batch after batch). The question it
answers: whether that cost is per batch (flat in the blocks a batch holds) or per block, which is
what --kv-batch-mib trades (bench/README.md, twenty-second session).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first

from bench.transfer_overhead import LAYOUT, Batches, paired_core  # noqa: E402
from kvtransport.events import FailReason  # noqa: E402
from kvtransport.receiver_state import Reservation  # noqa: E402
from kvtransport.testing import make_pool  # noqa: E402

NUM_BLOCKS = 256


def batch_cost(block_size: int, batch_bytes: int, rounds: int, num_blocks: int = NUM_BLOCKS) -> dict[str, float]:
    """Median us of landing() and landed(), after the batch's copies and cold; blocks a batch."""
    src = make_pool(num_blocks=num_blocks, block_size=block_size, seed=0, **LAYOUT)
    core, _ = paired_core(src, num_blocks, batch_bytes)
    batches = Batches(src, num_blocks, batch_bytes)
    evict_to, evict_from = memoryview(bytearray(8 << 20)), memoryview(bytearray(8 << 20))
    modes = ("", "_cold", "_warm")       # the rounds take them in turn
    times: dict[str, list[float]] = {call + mode: [] for mode in modes for call in ("landing", "landed")}
    for r in range(rounds):
        xfer, mode = f"x{r}", modes[r % len(modes)]
        cold = mode == "_cold"
        core.register(Reservation(xfer, tuple(batches.ids)))
        for header, seal, *payloads in batches.sealed(xfer, split=True):
            if cold:
                evict_to[:] = evict_from
            start = time.perf_counter()
            landing = core.landing("p", memoryview(header), memoryview(seal), True)
            landed_at = time.perf_counter()
            if landing is None:
                raise RuntimeError("a batch did not land")
            for slot, payload in zip(landing.slots, payloads):
                core.owed("p")
                if mode != "_warm":
                    slot[:] = payload
                landing.sizes.append(len(payload))
            if cold:
                evict_to[:] = evict_from
            done = time.perf_counter()
            core.landed("p", landing, landing.sizes, 0.0)
            end = time.perf_counter()
            if r >= len(modes):
                times["landing" + mode].append((landed_at - start) * 1e6)
                times["landed" + mode].append((end - done) * 1e6)
        core.ledger.abort(xfer, FailReason.LOCAL_ABORT)     # no Commit: the next round reuses the blocks
    if core.metrics.frames_dropped:
        raise RuntimeError(f"dropped frames: {core.metrics}")
    return {k: statistics.median(v) for k, v in times.items()} | {"blocks_a_batch": batches.step,
                                                                    "block_mib": batches.nbytes / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-size", type=int, default=64, help="tokens a block (64: 2 MiB with this layout)")
    ap.add_argument("--batch-mib", default="16,64,128")
    ap.add_argument("--rounds", type=int, default=60, help="transfers of 256 blocks per batch size (3 warm up)")
    args = ap.parse_args()
    for mib in map(int, args.batch_mib.split(",")):
        c = batch_cost(args.block_size, mib << 20, max(6, args.rounds))
        n = c["blocks_a_batch"]
        print(f"{c['block_mib']:.1f} MiB blocks, {mib} MiB batches ({n} blocks): us a batch, after copies / cold: "
              f"landing {c['landing']:.1f} / {c['landing_cold']:.1f}, "
              f"landed {c['landed']:.1f} / {c['landed_cold']:.1f}; "
              f"a block: {(c['landing'] + c['landed']) / n:.1f} / {(c['landing_cold'] + c['landed_cold']) / n:.1f}; "
              f"warm: landing {c['landing_warm']:.1f}, landed {c['landed_warm']:.1f}")


if __name__ == "__main__":
    main()
