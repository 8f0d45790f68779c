"""Preemption cost, swap vs recompute, by block size (the vLLM paper's Fig. 19 question) on
pdserve's engine: the same workload through a KV pool too small for it, once preempting by
recomputation and once by swapping to the host swap pool.

    python bench/swap_vs_recompute.py            # block sizes 8, 16, 32, 64

Prints wall time, preemptions and tokens/s per (mode, block size), and checks that both modes
produce the same tokens. On a CPU "device" a swap is a host-to-host copy, so this measures the
bookkeeping and copy cost, not PCIe: say so when quoting.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.beam_sharing import SMALL  # noqa: E402
from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def run(path: str, mode: str, block_size: int, prompts, args) -> dict:
    tokens_in_pool = args.pool_tokens
    llm = LLM(path, block_size=block_size, num_blocks=tokens_in_pool // block_size, enable_prefix_caching=False,
              swap_space_gib=0.25, preemption_mode=mode, max_num_seqs=len(prompts))
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    sched = llm.engine.scheduler
    llm.engine.check_integrity()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": elapsed, "tokens_per_s": tokens / elapsed, "preemptions": sched.num_preemptions,
            "swaps_out": sched.swap.num_swaps_out if sched.swap else 0,
            "tokens": [[c.token_ids for c in o.outputs] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--pool-tokens", type=int, default=2048, help="KV pool size in tokens (forces preemption)")
    args = ap.parse_args()
    path = make_random_llama(os.path.join(os.path.dirname(__file__), ".cache", "llama-small"), **SMALL)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, SMALL["vocab_size"], (args.input_len,), generator=g).tolist()
               for _ in range(args.requests)]
    results = {}
    for bs in args.block_sizes:
        swap = run(path, "swap", bs, prompts, args)
        recompute = run(path, "recompute", bs, prompts, args)
        same = swap.pop("tokens") == recompute.pop("tokens")
        results[bs] = {"swap": swap, "recompute": recompute, "same_tokens": same}
        print(f"block {bs:3d}: swap {swap['seconds']:6.2f} s ({swap['preemptions']} preemptions), "
              f"recompute {recompute['seconds']:6.2f} s ({recompute['preemptions']}), "
              f"swap/recompute time {swap['seconds'] / recompute['seconds']:.2f}, same tokens: {same}")
    out = write_result("swap_vs_recompute", {"args": vars(args), "model": SMALL, "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
