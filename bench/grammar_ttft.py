"""TTFT and first decode step of structured requests whose JSON schema is new to the nodes, served
disaggregated (`pdserve up --prefill 1 --decode 1 --routing affinity`: every prompt through the
prefill node), one request at a time: each schema compiles on both nodes before its first token.

    python -m bench.grammar_ttft [--checkout PATH] [--requests 8] [--cache-dir DIR]

--checkout runs the servers from another checkout (e.g. the main branch, for a before/after in one
machine state). Per request: TTFT (the first streamed token, from the prefill node) and the gap to
the second (the decode node's first step, after the KV transfer); the same for plain requests.
Model: bench/structured_model.py (vocab 32,000, byte-level BPE).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import httpx

from bench.serving.servers import Knobs, pdserve_disaggregated, running
from bench.structured_model import BENCH_SCHEMA, prepare_structured_model

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 8431


def fresh_schema(i: int) -> dict:
    """BENCH_SCHEMA with field lengths of its own (a schema no node compiled before), bounded."""
    props = dict(BENCH_SCHEMA["properties"])
    props["name"] = {"type": "string", "minLength": 1, "maxLength": 60 + i}
    props["email"] = {"type": "string", "maxLength": 80 + i}
    props[f"note{i}"] = {"type": "string", "maxLength": 40}
    return {**BENCH_SCHEMA, "properties": props, "required": [*BENCH_SCHEMA["required"], f"note{i}"]}


def timed(client: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    """(TTFT, gap from the first token to the second) of one streamed completion, in seconds."""
    start, stamps = time.perf_counter(), []
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                stamps.append(time.perf_counter())
                if len(stamps) == 2:
                    break
    return stamps[0] - start, stamps[1] - stamps[0]


def measure(url: str, model: str, requests: int) -> dict:
    base = {"model": model, "prompt": "Describe one person as JSON:", "max_tokens": 64, "temperature": 0.0}
    out: dict[str, list] = {"plain": [], "fresh_schema": []}
    with httpx.Client(timeout=120) as client:
        timed(client, url, {**base, "guided_json": fresh_schema(-1)})       # warm: compilers, workers
        for i in range(requests):
            out["plain"].append(timed(client, url, {**base, "max_tokens": 8, "ignore_eos": True}))
            out["fresh_schema"].append(timed(client, url, {**base, "guided_json": fresh_schema(i)}))
    return {kind: {"ttft_ms_median": round(1000 * statistics.median(t for t, _ in runs), 1),
                   "first_decode_ms_median": round(1000 * statistics.median(g for _, g in runs), 1),
                   "ttft_ms": [round(1000 * t, 1) for t, _ in runs]} for kind, runs in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", default=os.path.dirname(HERE), help="the pdserve checkout the servers run")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--cache-dir", default=os.path.join(HERE, ".cache"))
    args = ap.parse_args()
    path = prepare_structured_model(args.cache_dir)
    spec = pdserve_disaggregated(path, PORT, Knobs(kv_cache_gib=0.5, max_model_len=1024))
    spec = dataclasses.replace(spec, argv=(*spec.argv, "--routing", "affinity"), env={"PYTHONPATH": args.checkout})
    with running(spec, os.path.join(args.cache_dir, "logs", "grammar_ttft.log")) as endpoint:
        result = measure(f"{endpoint.base_url}/v1/completions", endpoint.model, args.requests)
    print(json.dumps({"checkout": args.checkout, "load": os.getloadavg(), **result}, indent=1))


if __name__ == "__main__":
    main()
