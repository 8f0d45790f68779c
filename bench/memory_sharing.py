"""The vLLM paper's memory-sharing experiment (its Fig. 15, parallel sampling) on pdserve's
block manager: n samples of one prompt share the prompt's blocks (`fork`), and a shared,
partly filled last block is copied on the first write (`append_slots` returns the copy).

    python bench/memory_sharing.py                     # ShareGPT- and Alpaca-like, n = 2, 4, 6

For each request (lengths from bench/serving/workloads.py; each of the n samples draws its own
output length), the prompt is allocated once and forked n - 1 times; then every unfinished
sample appends one token per step. Each step counts physical blocks in use against the blocks
the n samples would hold without sharing (the sum of their block-table lengths). The saving is
1 - sum(physical) / sum(logical) over all steps of all requests. Pure CPU simulation, fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.serving.workloads import ALPACA, SHAREGPT  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.sequence import Sequence  # noqa: E402


def share_one(bm: BlockManager, prompt_len: int, output_lens: list[int]) -> tuple[int, int, int]:
    """Run one request's n samples to the end; returns (sum of physical blocks in use over its
    steps, sum of logical blocks over its steps, copy-on-write copies made)."""
    parent = Sequence(list(range(prompt_len)), prompt_len)
    bm.allocate(parent)
    parent.num_computed_tokens = prompt_len
    seqs = [parent] + [parent.fork(i) for i in range(1, len(output_lens))]
    for child in seqs[1:]:
        bm.fork(parent, child)
    physical = logical = copies = 0
    live = list(zip(seqs, output_lens))
    while live:
        physical += bm.num_blocks - bm.num_free_blocks
        logical += sum(len(s.block_table) for s, _ in live)
        for seq, _ in live:
            seq.num_computed_tokens = len(seq)
            seq.token_ids.append(seq.seq_id)             # samples differ from their first token on
            copies += len(bm.append_slots(seq))
        if len(seqs[0]) % 64 == 0:
            bm.check_integrity([s for s, _ in live])
        for seq, out in [(s, o) for s, o in live if s.num_output_tokens >= o]:
            bm.free(seq)
        live = [(s, o) for s, o in live if s.num_output_tokens < o]
    bm.check_integrity([])
    return physical, logical, copies


def saving(lengths, n: int, num_requests: int, seed: int, block_size: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    prompts = lengths[0].sample(rng, num_requests, 1, 1024)
    outputs = lengths[1].sample(rng, num_requests * n, 1, 1024).reshape(num_requests, n)
    bm = BlockManager(1024, block_size, enable_prefix_caching=False)
    physical = logical = copies = 0
    for p, outs in zip(prompts, outputs):
        ph, lo, co = share_one(bm, int(p), [int(o) for o in outs])
        physical, logical, copies = physical + ph, logical + lo, copies + co
    return {"n": n, "saving": 1 - physical / logical, "cow_copies_per_request": copies / num_requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = {"bench": "memory_sharing", "args": vars(args), "block_size": 16, "workloads": {}}
    for name, lengths in (("sharegpt", SHAREGPT), ("alpaca", ALPACA)):
        rows = [saving(lengths, n, args.num_requests, args.seed) for n in (2, 4, 6)]
        out["workloads"][name] = rows
        print(f"{name:9s} " + "  ".join(f"n={r['n']}: {r['saving']:5.1%} saved ({r['cow_copies_per_request']:.1f} "
                                        f"CoW copies/request)" for r in rows))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_sharing.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
