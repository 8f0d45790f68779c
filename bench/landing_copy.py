"""The landing copy alone: glibc's memcpy against kvtransport/stream_copy.py's streaming stores,
one thread, each block into a random slot of a cold pool, from a warm or a cold source.

    .venv/bin/python bench/landing_copy.py [--pool-mib 256] [--copies 4096] [--rounds 2]

Per block size (16 KiB to 2 MiB), rounds alternate memcpy and streaming; us a copy, median of the
rounds. "warm": the sources are 4 blocks copied over and over (as libzmq's freshly received
frames); "cold": each from a different block of a 64 MiB source; "hot destination": 8 slots
rewritten over and over (where streaming stores lose). The ceiling beside it: one large memcpy's
GB/s on this machine. Writes bench/results/landing_copy_<time>.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first

import numpy as np  # noqa: E402

from bench.machine import write_result  # noqa: E402
from kernels.cpu_kernels import stream_copy_lib  # noqa: E402

SIZES_KIB = (16, 64, 256, 512, 2048)
SOURCE_BYTES = 64 << 20


def timed(copy, dst: int, src: int, nbytes: int, slots: list[int], sources: list[int]) -> float:
    """us a copy of nbytes from src + sources[k] * nbytes into dst + slots[k] * nbytes."""
    start = time.perf_counter()
    for slot, source in zip(slots, sources):
        copy(dst + slot * nbytes, src + source * nbytes, nbytes)
    return (time.perf_counter() - start) / len(slots) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--copies", type=int, default=4096, help="copies a measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both copies")
    args = ap.parse_args()
    lib = stream_copy_lib()
    if lib is None:
        sys.exit("the streaming copy did not build (kernels/cpu_kernels.py build_error('stream_copy'))")
    memcpy = ctypes.CDLL(None).memcpy
    memcpy.argtypes, memcpy.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p
    copies = {"memcpy": memcpy, "streaming": lib.stream_copy}
    pool, src = np.ones(args.pool_mib << 20, np.uint8), np.ones(SOURCE_BYTES, np.uint8)    # touched: mapped
    big = time.perf_counter()
    np.copyto(pool[:SOURCE_BYTES], src)
    ceiling = SOURCE_BYTES / (time.perf_counter() - big) / 1e9
    rows = []
    for kib in SIZES_KIB:
        nbytes = kib << 10
        num = len(pool) // nbytes
        cases = {"warm": lambda: [random.randrange(4) for _ in range(args.copies)],
                 "cold": lambda: [random.randrange(SOURCE_BYTES // nbytes) for _ in range(args.copies)]}
        row = {"kib": kib}
        for case, sources in cases.items():
            runs = {name: [] for name in copies}
            for r in range(args.rounds):
                for name in (list(copies) if r % 2 == 0 else list(copies)[::-1]):
                    slots = [random.randrange(num) for _ in range(args.copies)]
                    runs[name].append(timed(copies[name], pool.ctypes.data, src.ctypes.data, nbytes, slots, sources()))
            row[case] = {name: statistics.median(us) for name, us in runs.items()}
        hot = {name: statistics.median(timed(copy, pool.ctypes.data, src.ctypes.data, nbytes,
                                             [k % 8 for k in range(args.copies)], [k % 4 for k in range(args.copies)])
                                       for _ in range(args.rounds)) for name, copy in copies.items()}
        row["hot destination"] = hot
        rows.append(row)
        print(f"{kib:5d} KiB  us a copy, memcpy -> streaming: " + ", ".join(
            f"{case} {row[case]['memcpy']:.2f} -> {row[case]['streaming']:.2f}" for case in ("warm", "cold", "hot destination")),
            flush=True)
    print(f"one {SOURCE_BYTES >> 20} MiB memcpy (the ceiling): {ceiling:.1f} GB/s")
    write_result("landing_copy", {"pool_mib": args.pool_mib, "copies": args.copies, "rounds": args.rounds,
                                  "memcpy_gbps": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
