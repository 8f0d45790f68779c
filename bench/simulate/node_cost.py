"""What a node adds to a prefill step beside the bare engine (issue #18, trace finding 4): the
same prompt lengths, random tokens (no prefix hits), one at a time, through

    bare   the engine alone, as `pdserve profile` times it (run it pinned, one thread:
           `OMP_NUM_THREADS=1 taskset -c 0 python -m bench.simulate.node_cost bare --out B.json`)
    node   a real 1P+1D (`pdserve up`, processes on loopback sockets, pinned as measure.py pins),
           traced (trace_points.py): each engine step's thread CPU time on the prefill node (prompts
           past the router's 64-token local-prefill limit) and on the decode node (the shorter
           ones, prefilled there), and the shipper's share of it

    python -m bench.simulate.node_cost node --out N.json [--node-flag=--kv-layer-groups=1 ...]
    python -m bench.simulate.node_cost compare B.json N.json [N2.json ...]
    python -m bench.simulate.node_cost warm --out W.json    (pinned, one thread, as bare: a cached
           document and a short question after it, the warm RAG request's step)

Thread CPU time, not wall time: what another process takes from the core does not count.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from dataclasses import replace

import numpy as np

P_LENS = (80, 160, 320, 640, 1200)      # over the router's local-prefill limit: the prefill node
D_LENS = (24, 48, 64)                    # at most 64 tokens: the decode node prefills them itself
GAP_S = 0.3                              # idle between prompts, in both modes (the caches cool alike)
WARM_DOCS = (1024, 2048, 3072)           # warm: a cached document (RAG's are 1.8-3.7k tokens) ...
WARM_TAILS = (16, 32, 64)                # ... and the question after it (the router prefills <= 64 on D)


def bare(model: str, repeats: int) -> list[dict]:
    from pdwire.sampling_params import SamplingParams
    engine, rec = _bare_engine(model)
    rng, steps = np.random.default_rng(1), []
    for i, n in enumerate(_order(repeats)):
        ids = [int(t) for t in rng.integers(3, engine.model_config.vocab_size, n)]
        engine.add_request(f"b{i}", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            steps.append({"shapes": rec.last, "cpu": time.thread_time() - c0, "wall": time.perf_counter() - t0})
        time.sleep(GAP_S)
    return steps


def warm(model: str, repeats: int) -> list[dict]:
    """A warm RAG question as the engine sees it: a document prefilled once (cached), then
    document + a fresh short question, WARM_TAILS tokens, alone; add_request (tokens hashed, the
    prefix matched) and each step timed, in a shuffled order."""
    from pdwire.sampling_params import SamplingParams
    engine, rec = _bare_engine(model)
    rng, steps, vocab = np.random.default_rng(2), [], engine.model_config.vocab_size
    docs = {n: [int(t) for t in rng.integers(3, vocab, n)] for n in WARM_DOCS}
    order = [(d, t) for d in WARM_DOCS for t in WARM_TAILS] * repeats
    np.random.default_rng(0).shuffle(order)
    for i, (d, t) in enumerate([(d, 1) for d in WARM_DOCS] + order):     # the documents first: cached
        ids = docs[d] + [int(x) for x in rng.integers(3, vocab, t)]
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.add_request(f"w{i}", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        add = {"add_cpu": time.thread_time() - c0, "add_wall": time.perf_counter() - t0}
        while engine.has_unfinished_requests():
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            steps.append({"shapes": rec.last, "cpu": time.thread_time() - c0, "wall": time.perf_counter() - t0,
                          "doc": d, "tail": t, "cached": i >= len(WARM_DOCS)} | add)
            add = {}
        time.sleep(GAP_S)
    return steps


def _bare_engine(model: str):
    from engine.args import EngineArgs
    from pdplan.profiler import Profiler
    k = _knobs()
    args = EngineArgs(model=model, dtype=k.dtype, kv_cache_gib=k.kv_cache_gib, max_num_seqs=k.max_num_seqs,
                      max_num_batched_tokens=k.max_num_batched_tokens, max_model_len=k.max_model_len)
    return Profiler(args)._engine()


def node(model: str, repeats: int, flags: list[str], out_dir: str) -> list[dict]:
    from bench.serving.servers import REPO, running
    from bench.simulate import trace
    from bench.simulate.measure import _root, server
    from bench.simulate.pinning import PINS, pin_nodes, prioritize
    from bench.serving.compare import free_port
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    srv = server("1p1d", model, port, _knobs())
    srv = replace(srv, argv=(*srv.argv, *flags),
                  env=srv.env | {"PYTHONPATH": f"{REPO}:{trace.HOOK}", "PDSERVE_TRACE_DIR": out_dir})
    rng = np.random.default_rng(1)
    with running(srv, os.path.join(out_dir, "server.log")) as endpoint:
        time.sleep(1.0)
        print("pinned", pin_nodes(_root(port), PINS["1p1d"]), "autogroup nice", prioritize(_root(port)), flush=True)
        for n in (100, 30, 100, 30):                                 # warm-up, not kept
            _complete(endpoint, [int(t) for t in rng.integers(3, 30000, n)])
        time.sleep(1.0)
        start = time.monotonic()
        for n in _order(repeats):
            _complete(endpoint, [int(t) for t in rng.integers(3, 30000, n)])
            time.sleep(GAP_S)
    events = [e for e in trace.load(out_dir) if e["e"] == "step" and e["t0"] >= start]
    return [{"node": e["p"].split("-")[0], "shapes": e["shapes"], "cpu": e["cpu"], "wall": e["t"] - e["t0"],
             "ship_cpu": e.get("ship_cpu")} for e in events]


def _complete(endpoint, ids: list[int]) -> None:
    body = json.dumps({"model": endpoint.model, "prompt": ids, "max_tokens": 2, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(endpoint.base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _order(repeats: int) -> list[int]:
    lens = [n for n in P_LENS + D_LENS] * repeats
    np.random.default_rng(0).shuffle(lens)
    return lens


def _knobs():
    from bench.serving.servers import Knobs
    return Knobs()


def compare(bare_file: str, node_files: list[str]) -> str:
    """Per prompt length: the bare engine's step CPU (median), each node's, their ratio, the shipper's share."""
    def prefills(steps, who=None):
        out: dict[int, list[dict]] = {}
        for s in steps:
            if len(s["shapes"]) == 1 and s["shapes"][0][1] == 0 and s["shapes"][0][0] > 1 \
                    and (who is None or s.get("node") == who):
                out.setdefault(s["shapes"][0][0], []).append(s)
        return out
    base = prefills(json.load(open(bare_file))["steps"])
    lines = ["| file | node | tokens | bare CPU ms (n) | node CPU ms (n) | node / bare | shipper CPU ms | node wall ms |",
             "|---|---|---|---|---|---|---|---|"]
    for f in node_files:
        steps = json.load(open(f))["steps"]
        for who in ("prefill", "decode"):
            for n, got in sorted(prefills(steps, who).items()):
                if n not in base:
                    continue
                b = statistics.median(s["cpu"] for s in base[n]) * 1e3
                c = statistics.median(s["cpu"] for s in got) * 1e3
                ship = statistics.median(sum((s["ship_cpu"] or {}).values()) for s in got) * 1e3
                w = statistics.median(s["wall"] for s in got) * 1e3
                lines.append(f"| {os.path.basename(f)} | {who} | {n} | {b:.2f} ({len(base[n])}) | {c:.2f} ({len(got)}) "
                             f"| {c / b:.2f} | {ship:.2f} | {w:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate.node_cost", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("bare", "node", "warm", "compare"))
    ap.add_argument("files", nargs="*", help="compare: the bare file, then node files")
    ap.add_argument("--model", default="bench/.cache/serving-llama-58m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--node-flag", action="append", default=[], help="added to `pdserve up` (e.g. --kv-layer-groups=1)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.mode == "compare":
        return print(compare(a.files[0], a.files[1:]))
    t0 = time.time()
    steps = bare(a.model, a.repeats) if a.mode == "bare" else warm(a.model, a.repeats) if a.mode == "warm" else \
        node(a.model, a.repeats, a.node_flag, a.out.removesuffix(".json") + "_trace")
    with open(a.out, "w") as f:
        json.dump({"mode": a.mode, "flags": a.node_flag, "started": t0, "loadavg": os.getloadavg(), "steps": steps}, f)
    print(f"{a.mode}: {len(steps)} steps -> {a.out}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
