"""KV block transfer throughput over the ZMQ backend, prefill process -> decode process, beside
the raw-ZeroMQ ceiling in the same run.

    .venv/bin/python bench/transfer_bench.py [--tokens 8192] [--repeats 16] [--max-seconds 60] [--chunk 2048]
        [--quick] [--batch-mib 16] [--queue-mib 256] [--heap retain|default] [--no-split-payloads]

Layout: the 58.5M Llama (8 layers, 8 KV heads, head_dim 64, fp32), block sizes 16/32/64
tokens (0.5/1/2 MiB per block). The decode side runs in its own process with a ZmqReceiver;
this process reserves blocks there, ships a `--tokens` prompt and stops the clock when the
receiver reports the transfer committed (end to end: header, zero-copy send, socket, checks,
copy into the reserved blocks, commit). Every connection is authenticated (kvtransport.session).
Variants, in every round (round 0 warms up), in one of two orders that alternate from round to
round (ORDERS): pdserve runs right between the raw ceiling and ceiling_stream (the MAC ceiling one
further), so each ratio pairs runs close in time, and each ceiling runs once before pdserve and
once after it in every two rounds. A block size runs --repeats rounds (16; 200 at most), or fewer once --max-seconds (60;
3600 at most) have passed since its first (then an even count, 2 at least):

  pdserve      send_blocks per --chunk tokens (as a prefill step hands them): BlockBatch messages
  unbatched    send_block per block: one BlockFrame message each (the path before batching)
  ceiling      raw pyzmq, zero-copy blocks, one memcpy each into a pool (bench/transfer_ceiling.py)
  ceiling_mac  the same with a small header sealed and opened per block (one MAC each)
  ceiling_stream  raw pyzmq with pdserve's copy: each block received zero-copy and copied into
               the pool with streaming stores (kvtransport/stream_copy.py), no header, no MAC

The decode process (bench/transfer_pdserve.py) takes a batch's payloads as messages of their own
unless --no-split-payloads (then as frames of the batch's message: the wire before the twelfth
session).
Both receiving processes keep the memory of freed frames (kvtransport.heap, as a ZmqReceiver
does) unless --heap default runs both with glibc's defaults (the state before the eleventh session).

Ratios and overheads are taken per round (pdserve's time against the ceiling's in the same round,
its neighbour: drift between rounds cancels), then their median and spread (quartiles, min..max;
bench/paired.py): the per-block overhead is the median of the rounds' wall differences, and the
receiving Python thread's CPU likewise; the difference of the two variants' own medians (the
figure before the twenty-first session) is kept in the JSON as *_overhead_of_medians_*. Rows: TCP,
IPC. Prints machine info (with the load average: the machine is shared) and writes
bench/results/transfer_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first

from pdwire.messages import BATCH_BYTES, RECV_QUEUE_BYTES, SPLIT_PAYLOADS  # noqa: E402

from bench.paired import paired_differences, paired_ratios  # noqa: E402
from bench.transfer_ceiling import Ceiling  # noqa: E402
from bench.transfer_pdserve import Pdserve, Run  # noqa: E402

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


ROUNDS, MAX_ROUNDS = 16, 200              # measured rounds per block size: the default, the most
ROUND_SECONDS, MAX_ROUND_SECONDS = 60.0, 3600.0   # a block size's rounds stop after this (default, most)
VARIANTS = ("pdserve", "unbatched", "ceiling", "ceiling_mac", "ceiling_stream")
ORDERS = (("ceiling_mac", "ceiling_stream", "pdserve", "ceiling", "unbatched"),     # repetition r runs ORDERS[r % 2]
          ("unbatched", "ceiling", "pdserve", "ceiling_stream", "ceiling_mac"))


@dataclass(frozen=True)
class Setup:
    """What every block size of one bench run shares (main() fills it from the command line)."""
    tokens: int = 8192
    repeats: int = ROUNDS                   # measured rounds per block size, at most
    chunk_tokens: int = 2048
    batch_bytes: int = BATCH_BYTES
    queue_bytes: int = RECV_QUEUE_BYTES
    retain_heap: bool = True
    split: bool = SPLIT_PAYLOADS
    max_seconds: float = ROUND_SECONDS      # no round starts after this (an even count, 2 at least, kept)
    variants: tuple[str, ...] = VARIANTS    # pdserve and ceiling at least


def run_case(block_size: int, bind: str, secret: bytes, setup: Setup) -> dict:
    """setup.variants on one block size, in ORDERS alternating by round (round 0 warms up): up to
    setup.repeats measured rounds, fewer once setup.max_seconds have passed."""
    pd = Pdserve(block_size, setup.tokens, bind, secret, setup.batch_bytes, setup.queue_bytes, setup.retain_heap,
                 setup.split)
    ceiling_bind = bind + "-ceiling" if bind.startswith("ipc://") else bind
    ceiling = Ceiling(pd.src, ceiling_bind, secret, setup.retain_heap)
    for side in (pd, ceiling):
        side.start()
    runs = {
        "pdserve": lambda: pd.run(max(1, setup.chunk_tokens // block_size)),
        "unbatched": lambda: pd.run(0),
        "ceiling": lambda: Run(*ceiling.run(mac=False)),
        "ceiling_mac": lambda: Run(*ceiling.run(mac=True)),
        "ceiling_stream": lambda: Run(*ceiling.run(mac=False, stream=True)),
    }
    got: dict[str, list[Run]] = {v: [] for v in setup.variants}
    orders = [[v for v in order if v in got] for order in ORDERS]
    try:
        deadline = time.monotonic() + setup.max_seconds
        for rep in range(setup.repeats + 1):
            if rep >= 2 and rep % 2 == 1 and time.monotonic() > deadline:
                break                       # rep - 1 rounds measured: an even count
            for variant in orders[rep % 2]:
                result = runs[variant]()
                if rep:
                    got[variant].append(result)
    finally:
        pd.stop()
        ceiling.stop()
        for path in {bind, ceiling_bind}:
            if path.startswith("ipc://") and os.path.exists(path[len("ipc://"):]):
                os.unlink(path[len("ipc://"):])
    nbytes = pd.src[0].numel() * pd.src.element_size() * pd.num_blocks
    return _summary(block_size, pd.num_blocks, nbytes, got)


def _summary(block_size: int, num_blocks: int, nbytes: int, got: dict[str, list[Run]]) -> dict:
    """Per variant: GB/s and wall us per block (median, range), and CPU us per block of each
    process (all its threads: load on other cores does not inflate it); pdserve's (and
    unbatched's) ratios and overheads, each taken per round against the ceiling of that round
    (its neighbour in time), then the median and spread over the rounds."""
    row = {"block_size": block_size, "block_mib": nbytes / num_blocks / 2**20, "blocks": num_blocks,
           "mib": nbytes / 2**20, "rounds": len(got["pdserve"])}
    per_block = lambda xs: statistics.median(xs) / num_blocks * 1e6    # noqa: E731
    for variant, runs in got.items():
        walls = [r.wall for r in runs]
        row[variant] = {"gbps": nbytes / statistics.median(walls) / 1e9,
                        "gbps_range": [nbytes / max(walls) / 1e9, nbytes / min(walls) / 1e9],
                        "us_per_block": per_block(walls),
                        "send_cpu_us_per_block": per_block([r.send_cpu for r in runs]),
                        "recv_cpu_us_per_block": per_block([r.recv_cpu for r in runs]),
                        "recv_faults_per_block": statistics.median(r.recv_faults for r in runs) / num_blocks,
                        "recv_main_cpu_us_per_block": per_block([r.recv_main_cpu for r in runs]),
                        "recv_main_switches_per_block": statistics.median(r.recv_main_switches for r in runs) / num_blocks,
                        "rounds": [list(r) for r in runs]}     # every round's Run, in order (seconds, faults)
    us = 1e6 / num_blocks
    for variant in [v for v in ("unbatched", "pdserve") if v in got]:
        mine = got[variant]
        for peer in [v for v in ("ceiling", "ceiling_mac", "ceiling_stream") if v in got]:   # each against its own round's
            ratios = paired_ratios([r.wall for r in mine], [r.wall for r in got[peer]])
            row[f"{variant}/{peer}"] = [ratios.lo, ratios.median, ratios.hi]
            row[f"{variant}/{peer}_spread"] = ratios.as_dict()
            row[f"{variant}_over_{peer}_us_per_block"] = paired_differences(
                [r.wall for r in mine], [r.wall for r in got[peer]]).scaled(us).as_dict()
        wall = paired_differences([r.wall for r in mine], [r.wall for r in got["ceiling"]]).scaled(us)
        row[f"{variant}_overhead_us_per_block"] = wall.median          # the median of the rounds' differences
        row[f"{variant}_overhead_spread"] = wall.as_dict()
        row[f"{variant}_overhead_of_medians_us_per_block"] = row[variant]["us_per_block"] - row["ceiling"]["us_per_block"]
        row[f"{variant}_cpu_overhead_us_per_block"] = {
            side: paired_differences([getattr(r, f"{side}_cpu") for r in mine],
                                     [getattr(r, f"{side}_cpu") for r in got["ceiling"]]).scaled(us).median
            for side in ("send", "recv", "recv_main")}
        row[f"{variant}_recv_main_cpu_overhead_spread"] = paired_differences(
            [r.recv_main_cpu for r in mine], [r.recv_main_cpu for r in got["ceiling"]]).scaled(us).as_dict()
        row[f"{variant}_total_cpu_overhead_spread"] = paired_differences(     # both processes: on 2 cores, what
            [r.send_cpu + r.recv_cpu for r in mine],                         # the wall time follows
            [r.send_cpu + r.recv_cpu for r in got["ceiling"]]).scaled(us).as_dict()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens per transfer")
    ap.add_argument("--repeats", type=int, default=ROUNDS,
                    help=f"measured rounds per block size at most (2-{MAX_ROUNDS}; even: both orders of the variants alike)")
    ap.add_argument("--max-seconds", type=float, default=ROUND_SECONDS,
                    help=f"no round starts after this many seconds of a block size's rounds (an even count, 2 at "
                         f"least, is kept; 1-{MAX_ROUND_SECONDS:.0f})")
    ap.add_argument("--chunk", type=int, default=2048,
                    help="tokens per send_blocks call (the engine's default token budget per step)")
    ap.add_argument("--quick", action="store_true", help="1024 tokens, 2 repeats")
    ap.add_argument("--transports", default="tcp,ipc", help="rows to run, comma-separated")
    ap.add_argument("--block-sizes", default="16,32,64", help="tokens per block, comma-separated")
    ap.add_argument("--batch-mib", type=int, default=BATCH_BYTES >> 20,
                    help="payload MiB of one BlockBatch (the nodes' --kv-batch-mib)")
    ap.add_argument("--queue-mib", type=int, default=RECV_QUEUE_BYTES >> 20,
                    help="payload MiB the decode process lets the sender queue (the nodes' --kv-recv-queue-mib)")
    ap.add_argument("--heap", choices=("retain", "default"), default="retain",
                    help="retain: both receiving processes keep freed frames, as a ZmqReceiver does "
                         "(kvtransport.heap); default: both run with glibc's defaults")
    ap.add_argument("--split-payloads", action=argparse.BooleanOptionalAction, default=SPLIT_PAYLOADS,
                    help="the decode process takes a batch's payloads as messages of their own (the nodes' "
                         "--kv-split-payloads)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="variants to run, comma-separated (pdserve and ceiling at least): fewer, more rounds in a time")
    args = ap.parse_args()
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if not 2 <= args.repeats <= MAX_ROUNDS or not 1 <= args.max_seconds <= MAX_ROUND_SECONDS:
        ap.error(f"--repeats must be in [2, {MAX_ROUNDS}] and --max-seconds in [1, {MAX_ROUND_SECONDS:.0f}]")
    if not {"pdserve", "ceiling"} <= set(variants) or set(args.variants.split(",")) - set(VARIANTS):
        ap.error(f"--variants: some of {','.join(VARIANTS)}, pdserve and ceiling among them")
    tokens, repeats = (1024, 2) if args.quick else (args.tokens, args.repeats)
    setup = Setup(tokens, repeats, args.chunk, args.batch_mib << 20, args.queue_mib << 20, args.heap == "retain",
                  args.split_payloads, args.max_seconds, variants)
    info = {**machine_info(), "memcpy_gbps": round(memcpy_gbps(), 2), "load_avg": os.getloadavg()}
    print(json.dumps(info, indent=1))
    rows = []
    for name in args.transports.split(","):
        for block_size in map(int, args.block_sizes.split(",")):
            bind = {"tcp": "tcp://127.0.0.1:*", "ipc": f"ipc:///tmp/kvt-bench-{os.getpid()}-{block_size}"}[name]
            row = {"transport": name, **run_case(block_size, bind, SECRET, setup)}
            rows.append(row)
            _print_row(name, row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": info, "tokens": tokens, "repeats": repeats, "chunk": args.chunk,
                                   "max_seconds": args.max_seconds, "variants": variants,
                                   "batch_mib": args.batch_mib, "queue_mib": args.queue_mib, "heap": args.heap,
                                   "split_payloads": args.split_payloads, "load_avg_after": os.getloadavg(),
                                   "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


def _print_row(name: str, row: dict) -> None:
    print(f"{name} block {row['block_size']} tok ({row['block_mib']:.1f} MiB) x{row['blocks']}:")
    for variant in [v for v in VARIANTS if v in row]:
        v = row[variant]
        lo, hi = v["gbps_range"]
        print(f"  {variant:12s} {v['gbps']:5.2f} GB/s ({lo:.2f}-{hi:.2f}), {v['us_per_block']:6.1f} us/block; "
              f"CPU us/block: sender {v['send_cpu_us_per_block']:5.1f}, receiver {v['recv_cpu_us_per_block']:5.1f} "
              f"(its Python thread {v['recv_main_cpu_us_per_block']:5.1f}, {v['recv_main_switches_per_block']:.2f} "
              f"context switches/block); receiver page faults/block {v['recv_faults_per_block']:.0f}")
    for variant in [v for v in ("pdserve", "unbatched") if v in row]:
        r, m = row[f"{variant}/ceiling_spread"], row.get(f"{variant}/ceiling_mac")
        wall, cpu = row[f"{variant}_overhead_spread"], row[f"{variant}_cpu_overhead_us_per_block"]
        thread, total = row[f"{variant}_recv_main_cpu_overhead_spread"], row[f"{variant}_total_cpu_overhead_spread"]
        mac = f", / ceiling+MAC {m[1]:.2f} ({m[0]:.2f}-{m[2]:.2f})" if m else ""
        if (st := row.get(f"{variant}/ceiling_stream_spread")) is not None:
            over = row[f"{variant}_over_ceiling_stream_us_per_block"]
            mac += (f", / ceiling+streaming copy {st['median']:.2f} (95% CI {st['ci_lo']:.2f}-{st['ci_hi']:.2f}), "
                    f"{over['median']:.1f} us/block over it (95% CI {over['ci_lo']:.1f}..{over['ci_hi']:.1f})")
        print(f"  {variant} / ceiling {r['median']:.2f} (95% CI {r['ci_lo']:.2f}-{r['ci_hi']:.2f}; IQR {r['q1']:.2f}-"
              f"{r['q3']:.2f}, {r['lo']:.2f}-{r['hi']:.2f}){mac}; {row['rounds']} rounds")
        print(f"    overhead us/block, median of the rounds' differences: wall {wall['median']:.1f} "
              f"(95% CI {wall['ci_lo']:.1f}..{wall['ci_hi']:.1f}; IQR {wall['q1']:.1f}..{wall['q3']:.1f}, "
              f"{wall['lo']:.1f}..{wall['hi']:.1f}); CPU {cpu['send']:.1f} "
              f"sender + {cpu['recv']:.1f} receiver, its Python thread {thread['median']:.1f} "
              f"(95% CI {thread['ci_lo']:.1f}..{thread['ci_hi']:.1f}; IQR {thread['q1']:.1f}..{thread['q3']:.1f}); "
              f"both processes {total['median']:.1f} (95% CI {total['ci_lo']:.1f}..{total['ci_hi']:.1f})")


if __name__ == "__main__":
    main()
