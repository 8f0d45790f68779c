"""Decode attention with its KV cache out of the CPU caches, as in a step: one decode batch's paged
attention over every layer's own cache (blocks scattered in the pool), in GB/s of KV read, beside
the machine's memory-read ceiling measured in the same run (a torch sum over 400 MB, 1 and all threads).

    python bench/attention_dram.py [--seqs 32] [--context 190] [--layers 8] [--steps 30]
    python bench/attention_dram.py --base REV [--pairs 6] [--dtypes bfloat16]

With --base, REV's paged_decode kernel (built as bench/kernel_ab.py builds it) and this tree's take
turns, pair by pair (which goes first alternating): ms a step each, and this tree's / REV's per pair.

bench/attention_cpu.py compares the paged layout with contiguous SDPA; this one asks how close a
step's attention comes to the memory's read rate (bench/README.md, session 28: the bf16 kernel read
at ~15 GB/s of the 29 two threads read). Writes bench/results/attention_dram_<time>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.machine import write_result  # noqa: E402
from kernels.cpu_attention import paged_attention_cpu  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 8, 64, 16      # the bench model's attention (bench/random_model.py PEER_SHAPE)


def read_ceiling(threads: int, mib: int = 400, repeats: int = 5) -> float:
    """GB/s a torch sum over `mib` MiB of float32 reads with `threads` threads."""
    x = torch.ones(mib * 2**20 // 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    seconds = (time.perf_counter() - start) / repeats
    torch.set_num_threads(before)
    return x.numel() * 4 / seconds / 1e9


def attention(dtype: torch.dtype, seqs: int, context: int, layers: int, steps: int) -> dict:
    """ms a step of `layers` layers' decode attention and the KV GB/s it reads."""
    gen = torch.Generator().manual_seed(0)
    per = (context + BLOCK - 1) // BLOCK
    caches = [torch.randn(seqs * per, 2, BLOCK, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(layers)]
    tables = torch.randperm(seqs * per, generator=gen, dtype=torch.int32).view(seqs, per)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    queries = [torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(layers)]

    def step() -> None:
        for q, kv in zip(queries, caches):
            paged_attention_cpu(q, kv[:, 0], kv[:, 1], tables, cu, seq_lens, HEAD_DIM ** -0.5)
    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    kv_bytes = layers * seqs * context * 2 * HEADS * HEAD_DIM * caches[0].element_size()
    return {"ms_per_step": seconds * 1e3, "kv_mib": kv_bytes / 2**20, "gb_per_s": kv_bytes / seconds / 1e9}


def against_base(rev: str, dtypes: list[torch.dtype], args) -> dict:
    """This tree's kernel against revision rev's, runs alternating (bench/kernel_ab.py's
    alternate): {dtype: {"runs_ms": {side: [ms a step, ...]}, "ratios": [this tree / rev, ...]}}."""
    import tempfile

    from bench.kernel_ab import alternate, build_base
    from bench.paired import paired_ratios, spread
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {rev: build_base(rev, ["paged_decode"], tmp), "this tree": None}
        for dtype in dtypes:
            runs = alternate(sides, args.pairs, lambda side, pair: attention(
                dtype, args.seqs, args.context, args.layers, args.steps)["ms_per_step"])
            ratios = [t / b for t, b in zip(runs["this tree"], runs[rev])]
            ratio = paired_ratios(runs[rev], runs["this tree"])         # this tree's time over rev's, per pair
            name = str(dtype).removeprefix("torch.")
            print(f"{name:9s} {args.layers} layers x {args.seqs} seqs x {args.context} tokens, ms a step: {rev} "
                  f"{spread(runs[rev]).median:.2f}, this tree {spread(runs['this tree']).median:.2f}; "
                  f"this tree / {rev} per pair {', '.join(f'{r:.2f}' for r in ratios)} (median {ratio.median:.3f}, "
                  f"95% CI {ratio.ci_lo:.3f}-{ratio.ci_hi:.3f}, faster in {sum(r < 1 for r in ratios)} of {len(ratios)})")
            out[name] = {"runs_ms": runs, "ratios": ratios}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=190)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--base", help="a git revision whose paged_decode to run against this tree's, alternating")
    ap.add_argument("--pairs", type=int, default=6, help="with --base: runs of each side")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if args.base:
        rows = against_base(args.base, dtypes, args)
        print(f"wrote {write_result('attention_dram', {'args': vars(args), 'against_base': rows})}")
        return 0
    ceiling = {threads: read_ceiling(threads) for threads in sorted({1, torch.get_num_threads()})}
    rows = {str(dtype).removeprefix("torch."): attention(dtype, args.seqs, args.context, args.layers, args.steps)
            for dtype in dtypes}
    print("memory read ceiling (torch sum, 400 MB): " + ", ".join(f"{g:.1f} GB/s with {t} thread(s)"
                                                               for t, g in ceiling.items()))
    best = max(ceiling.values())
    for name, r in rows.items():
        print(f"{name:9s} {args.layers} layers x {args.seqs} seqs x {args.context} tokens: {r['ms_per_step']:.2f} ms "
              f"a step, KV {r['kv_mib']:.0f} MiB at {r['gb_per_s']:.1f} GB/s ({r['gb_per_s'] / best:.0%} of the ceiling)")
    path = write_result("attention_dram", {"args": vars(args), "read_ceiling_gb_per_s": ceiling, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
