"""Blocks saved by beam search's sharing (the vLLM paper's Fig. 15, beam search), measured on
pdserve's real engine: beams fork block tables, dropped beams free theirs, shared partly
filled blocks are copied on write.

    python bench/beam_sharing.py                 # widths 2, 4, 6 on ShareGPT- and Alpaca-like lengths

Every step counts the physical blocks the running beams hold (distinct block ids) against the
blocks they would hold without sharing (the sum of their block-table lengths). Saving =
1 - sum(physical) / sum(logical) over all steps of all requests. A small random-weight Llama
stands in for a trained model (beam dynamics depend on the model: say so when quoting).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402
from bench.serving.workloads import ALPACA, SHAREGPT  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048)


def run_request(llm: LLM, prompt: list[int], width: int, max_tokens: int) -> tuple[int, int]:
    """(sum of physical blocks, sum of logical blocks) over the steps of one beam request."""
    engine = llm.engine
    engine.add_request("beam", prompt, SamplingParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    physical = logical = 0
    while engine.has_unfinished_requests():
        engine.step()
        for group in engine.scheduler.running:
            tables = [s.block_table for s in group.unfinished()]
            physical += len({b for t in tables for b in t})
            logical += sum(len(t) for t in tables)
    return physical, logical


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="requests per workload and width")
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256, help="cap on output lengths (CPU time)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = make_random_llama(os.path.join(os.path.dirname(__file__), ".cache", "llama-small"), **SMALL)
    llm = LLM(path, block_size=args.block_size, num_blocks=4096, enable_prefix_caching=False)
    rng = np.random.default_rng(args.seed)
    results = {}
    for name, (prompt_dist, output_dist) in (("sharegpt", SHAREGPT), ("alpaca", ALPACA)):
        prompts = prompt_dist.sample(rng, args.requests, 4, 1024)
        outputs = output_dist.sample(rng, args.requests, 4, args.max_output)
        for width in args.widths:
            start, phys, logi = time.perf_counter(), 0, 0
            for p_len, o_len in zip(prompts, outputs):
                prompt = rng.integers(10, SMALL["vocab_size"], int(p_len)).tolist()
                p, lg = run_request(llm, prompt, width, int(o_len))
                phys, logi = phys + p, logi + lg
            saving = 1 - phys / logi
            results[f"{name}/beam{width}"] = {"saving": saving, "physical": phys, "logical": logi}
            print(f"{name:9s} beam width {width}: {100 * saving:5.1f}% of KV blocks saved "
                  f"({phys} physical vs {logi} logical block-steps, {time.perf_counter() - start:.1f} s)")
    llm.engine.check_integrity()
    out = write_result("beam_sharing", {"args": vars(args), "model": SMALL, "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
