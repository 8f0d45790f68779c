"""The decoder layers called directly (engine/direct_layers.py) against the same layers through
their nn.Modules, in one engine, on engine_throughput's workload.

    python bench/direct_layers.py [--dtype bfloat16] [--repeats 6]

The peers' 58.5M random Llama, 32 requests of 128 prompt and 128 output tokens, greedy (as
bench/engine_throughput.py). One engine; each repeat runs the workload once per side, the order
alternating, and reports output tok/s and the process's CPU seconds. "direct / modules" > 1 means
the direct layers are faster. Both sides must give the same tokens (checked). Writes
bench/results/direct_layers_<time>.json (bench/README.md, "The decoder layers called directly").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REQUESTS, PROMPT, OUTPUT = 32, 128, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    from engine import LLM, SamplingParams
    llm = LLM(make_random_llama(os.path.join(HERE, ".cache", "llama-58m")), dtype=args.dtype,
              max_num_seqs=REQUESTS, kv_cache_gib=2.0)
    model = llm.engine.runner.model
    sides = {"modules": None, "direct": model.direct}
    if sides["direct"] is None:
        sys.exit("this engine built no DirectLayers (PDSERVE_DIRECT_LAYERS=0, or a linear not packed)")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (PROMPT,), generator=g).tolist() for _ in range(REQUESTS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))    # warm up
    tok_s: dict[str, list[float]] = {side: [] for side in sides}
    cpu_s: dict[str, list[float]] = {side: [] for side in sides}
    tokens = {}
    for r in range(args.repeats):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            model.direct = sides[side]
            wall, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params)
            tok_s[side].append(REQUESTS * OUTPUT / (time.perf_counter() - wall))
            cpu_s[side].append(time.process_time() - cpu)
            tokens[side] = [o.outputs[0].token_ids for o in outs]
    model.direct = sides["direct"]
    llm.close()
    same = tokens["modules"] == tokens["direct"]
    ratios = [d / m for m, d in zip(tok_s["modules"], tok_s["direct"])]
    cpu_ratios = [m / d for m, d in zip(cpu_s["modules"], cpu_s["direct"])]
    for side in sides:
        print(f"{side:8s} tok/s {' '.join(f'{v:7.0f}' for v in tok_s[side])}   median {statistics.median(tok_s[side]):7.0f}"
              f"   CPU s median {statistics.median(cpu_s[side]):6.2f}")
    print(f"{args.dtype}: direct / modules, run by run {' '.join(f'{x:.3f}' for x in ratios)}: median "
          f"{statistics.median(ratios):.3f}; CPU seconds modules / direct median {statistics.median(cpu_ratios):.3f}; "
          f"same tokens: {same}")
    print("wrote", write_result("direct_layers", {
        "dtype": args.dtype, "repeats": args.repeats, "tok_s": tok_s, "cpu_s": cpu_s, "same_tokens": same,
        "ratio_median": statistics.median(ratios), "cpu_ratio_median": statistics.median(cpu_ratios)}))
    if not same:
        sys.exit("the two sides gave different tokens")


if __name__ == "__main__":
    main()
