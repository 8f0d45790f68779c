"""sim31: what a colocated server's front end takes from its engine's core. One traced `python -m router`
(the validation's colocated server: one engine thread, pinned to core 0), this script on core 1; the mixed
workload's 3,403-token prompt (its first word changed each time: no prefix hit) sent N times with the engine
idle and N times while a 46-token chat decodes. Per send: the send -> the router's backend has it
(gen_start), the tokenizing call's wall and CPU, and the engine steps it overlapped with their wall less
their thread's CPU (what other threads of the process took from them).
usage (repository root, nothing else running): PYTHONPATH=. python bench/validation/sim31/front_share.py [N]"""
import asyncio
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time

import httpx

from bench.serving.compare import SweepSpec, free_port
from bench.serving.loadgen import prompt_text
from bench.serving.model import prepare_model, word_vocab
from bench.serving.servers import BENCH, running
from bench.serving.workloads import generate
from bench.simulate.measure import server
from bench.serving.servers import REPO
from bench.simulate.pinning import cmdline, pin
from bench.simulate.trace import HOOK, load


def fresh(r):
    return dataclasses.replace(r, prompt_ids=(random.randrange(100, 5000),) + tuple(r.prompt_ids[1:]))


async def stream(c, url, text, n):
    body = {"model": "bench-llama", "prompt": text, "max_tokens": n, "temperature": 0.0, "stream": True, "ignore_eos": True}
    async with c.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            pass


async def trials(url, long, chat, vocab, n):
    sends = []
    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(stream(c, url, prompt_text(fresh(chat), vocab), 1) for _ in range(2)))
        for busy in [False, True] * n:
            bg = asyncio.create_task(stream(c, url, prompt_text(fresh(chat), vocab), 300)) if busy else None
            await asyncio.sleep(0.5)
            sends.append((busy, time.monotonic()))
            await stream(c, url, prompt_text(fresh(long), vocab), 1)
            if bg:
                await bg
    return sends


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    os.sched_setaffinity(0, {1})
    spec = SweepSpec(systems=("colocated",), workload="mixed", num_requests=24, rates=(0.25,))
    reqs = generate(spec.workload_at(0))
    long = next(r for r in reqs if r.kind == "long")
    chat = next(r for r in reqs if r.prompt_len == 46)
    vocab, model = word_vocab(), prepare_model(os.path.join(BENCH, ".cache"))
    tdir = tempfile.mkdtemp(prefix="front_share_")
    srv = server("colocated", model, free_port(), spec.knobs)
    srv = dataclasses.replace(srv, env=srv.env | {"PYTHONPATH": f"{REPO}:{HOOK}", "PDSERVE_TRACE_DIR": tdir})
    with running(srv, os.path.join(tdir, "server.log")) as endpoint:
        mark = f"--port {endpoint.base_url.rsplit(':', 1)[1]} "
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and mark in cmdline(int(p)) + " "):
            pin(pid, {0})
        sends = asyncio.run(trials(endpoint.base_url, long, chat, vocab, n))
        time.sleep(0.5)
    ev = load(tdir)
    rows = {False: [], True: []}
    print("| engine | send -> backend ms | tokenizing wall / CPU ms | steps overlapped | their wall - CPU ms |")
    print("|---|---|---|---|---|")
    for busy, t in sends:
        g = next(e for e in ev if e["e"] == "gen_start" and e["t"] > t and e.get("n") == long.prompt_len)
        w = next(e for e in ev if e["e"] == "work" and e["t"] > t and e.get("tokens") == long.prompt_len)
        steps = [e for e in ev if e["e"] == "step" and e["t"] > t and e["t0"] < g["t"]]
        lost = sum((e["t"] - e["t0"]) - e["cpu"] for e in steps)
        rows[busy].append((g["t"] - t, w["cpu"], lost))
        print(f"| {'decoding' if busy else 'idle'} | {1e3 * (g['t'] - t):.1f} | {1e3 * (w['t'] - w['t0']):.1f} / "
              f"{1e3 * w['cpu']:.1f} | {len(steps)} | {1e3 * lost:.1f} |")
    for busy, r in rows.items():
        print(f"{'decoding' if busy else 'idle'}: medians send -> backend {1e3 * statistics.median(x[0] for x in r):.1f} ms, "
              f"tokenizing CPU {1e3 * statistics.median(x[1] for x in r):.1f} ms, steps lost {1e3 * statistics.median(x[2] for x in r):.1f} ms")


if __name__ == "__main__":
    main()
