"""Where a decode step's time goes on a GPU: the engine's steps timed by the wall clock and by the
GPU's own kernel times (torch.profiler), on the random Llama bench/gpu_profile.py makes.

    python bench/gpu_step_profile.py [--shape llama2-7b] [--batch 4] [--out bench/results/gpu_step_profile.json]

Prints the step's wall time, the GPU's busy time in it (the sum of its kernels' times), the
operators with the most host time and the Python functions with the most own time (cProfile);
writes the same as JSON. A step whose GPU is busy for a small part of its wall time is bound by
the host (Python, launches), not by the device.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_profile import make_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed by the wall clock")
    ap.add_argument("--profiled", type=int, default=5, help="decode steps under torch.profiler")
    ap.add_argument("--out", default="bench/results/gpu_step_profile.json")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step_profile: SKIPPED - no CUDA device visible to torch")
        return 0
    from engine import LLM, SamplingParams

    path = make_model(f"/tmp/pdserve-{args.shape}", args.shape, args.device)
    llm = LLM(path, device=args.device, dtype="bfloat16", kv_cache_gib=8)
    engine = llm.engine
    steps = 3 + args.steps + args.profiled
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"s{i}", [(i * 31 + j * 7) % 1000 + 3 for j in range(args.context)], params)
    while any(len(g.seqs[0].token_ids) <= args.context for g in engine.scheduler.running) or \
            not engine.scheduler.running:
        engine.step()                   # the prompts in
    for _ in range(3):
        engine.step()                   # warm
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profiled):
            engine.step()
        profiled_wall = (time.perf_counter() - t0) / args.profiled
    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(args.profiled):
        engine.step()
    host.disable()
    stats = pstats.Stats(host)
    functions = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]   # by own time
    python_rows = [dict(function=f"{os.path.relpath(f[0]) if f[0].startswith('/') else f[0]}:{f[1]}({f[2]})",
                        calls_per_step=v[1] / args.profiled, own_us_per_step=v[2] / args.profiled * 1e6,
                        cumulative_us_per_step=v[3] / args.profiled * 1e6) for f, v in functions]
    events = prof.key_averages()
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]     # not the operators that launched them
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.profiled
    launches = sum(e.count for e in kernels) / args.profiled
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    rows = [dict(name=e.key, calls_per_step=e.count / args.profiled, host_us_per_step=e.self_cpu_time_total / args.profiled,
                 gpu_us_per_step=e.self_device_time_total / args.profiled) for e in top]
    wall_ms = statistics.median(walls) * 1e3
    result = dict(shape=args.shape, batch=args.batch, context=args.context, device=args.device,
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else "",
                  torch=torch.__version__, wall_ms_median=wall_ms, wall_ms_all=[w * 1e3 for w in walls],
                  profiled_wall_ms=profiled_wall * 1e3, gpu_busy_ms=gpu_us / 1e3,
                  gpu_busy_fraction=gpu_us / 1e3 / wall_ms, kernels_per_step=launches, top_host_ops=rows,
                  top_python_functions=python_rows)
    print(f"decode step, batch {args.batch} at context {args.context}: wall {wall_ms:.2f} ms (median of "
          f"{args.steps}); under the profiler {profiled_wall * 1e3:.2f} ms, GPU busy {gpu_us / 1e3:.2f} ms "
          f"({launches:.0f} kernels a step)")
    for r in rows:
        print(f"  {r['host_us_per_step']:9.0f} us host {r['gpu_us_per_step']:9.0f} us GPU "
              f"{r['calls_per_step']:7.1f}x  {r['name'][:70]}")
    print("  the Python functions with the most own time a step (cProfile):")
    for r in python_rows:
        print(f"  {r['own_us_per_step']:9.0f} us own {r['cumulative_us_per_step']:9.0f} us cum "
              f"{r['calls_per_step']:7.1f}x  {r['function'][-90:]}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
