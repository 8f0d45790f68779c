"""The stall a move leaves in a stream: a decode node is drained mid-stream (deadline ~0) and its
streams move to the other decode node, with their KV blocks (kv_move) or re-prefilled from prompt
+ the tokens already sent (reprefill: --kv-move-timeout-s 0). Per moved stream, the longest wait
between two of its outputs as the router yields them, against the median wait of every stream.

    python bench/move_gap.py [--prompt-tokens 768] [--streams 4] [--max-tokens 160] [--dtype float32]

One prefill and two decode node processes on this machine, the built-in model, affinity routing
(every prompt through the prefill node); one JSON line per mode, all in
bench/results/move_gap_<unix time>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.builtin import BUILTIN_MODEL_PATH  # noqa: E402
from bench.machine import write_result  # noqa: E402
from pdwire.sampling_params import SamplingParams  # noqa: E402
from router.cluster.disaggregated import DisaggregatedBackend  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.node_processes import ClusterConfig, NodeSpawner, stop_nodes  # noqa: E402

MODES = {"kv_move": 5.0, "reprefill": 0.0}      # mode -> --kv-move-timeout-s


async def _stream(backend, rid: str, prompt: list[int], params: SamplingParams, seen) -> None:
    async for out in backend.generate(rid, prompt, params):
        seen(rid, out)


async def one_mode(mode: str, args: argparse.Namespace) -> dict:
    config = RouterConfig(heartbeat_timeout_s=30.0, routing="affinity", kv_move_timeout_s=MODES[mode])
    secret = secrets.token_bytes(32)
    backend = DisaggregatedBackend.from_model(BUILTIN_MODEL_PATH, secret, config)
    cluster = ClusterConfig(1, 2)
    flags = ["--model", BUILTIN_MODEL_PATH, "--dtype", args.dtype, "--num-blocks", "512", "--block-size", "16"]
    nodes = NodeSpawner(await backend.start(), cluster, flags, secret).spawn_pools(cluster)
    try:
        while any(backend.server.info(n.node_id) is None for n in nodes):
            await asyncio.sleep(0.1)
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        await asyncio.gather(*(_stream(backend, f"warm{i}", [5, 6, 7], warm, lambda *_: None) for i in range(2)))
        rng = random.Random(0)
        prompts = {f"s{i}": [rng.randrange(3, 4000) for _ in range(args.prompt_tokens)] for i in range(args.streams)}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        arrivals: dict[str, list[float]] = {rid: [] for rid in prompts}
        moved: set[str] = set()

        def seen(rid: str, out) -> None:
            arrivals[rid].append(time.perf_counter())
            if not moved and min(len(a) for a in arrivals.values()) >= args.drain_at:
                where = {r: backend.placement(r)[0][1] for r in prompts}
                node = max(sorted(set(where.values())), key=list(where.values()).count)
                moved.update(r for r, d in where.items() if d == node)
                backend.operator.drain(node, deadline_s=0.001)
        await asyncio.gather(*(_stream(backend, rid, p, params, seen) for rid, p in prompts.items()))
        gaps = {rid: [b - a for a, b in zip(times, times[1:])] for rid, times in arrivals.items()}
        return {"mode": mode, "moved": len(moved), "prompt_tokens": args.prompt_tokens, "dtype": args.dtype,
                "moved_stream_max_gap_ms": sorted(round(1e3 * max(gaps[r]), 1) for r in moved),
                "median_gap_ms": round(1e3 * statistics.median(g for rid in gaps for g in gaps[rid]), 1),
                "loadavg": os.getloadavg()}
    finally:
        backend.close()
        stop_nodes(nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=768)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--drain-at", type=int, default=20, help="outputs every stream has when the drain starts")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    results = [asyncio.run(one_mode(mode, args)) for mode in MODES]
    for r in results:
        print(json.dumps(r))
    print("wrote", write_result("move_gap", {"results": results}))


if __name__ == "__main__":
    main()
