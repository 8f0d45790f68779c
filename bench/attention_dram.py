"""Decode attention with its KV cache out of the CPU caches, as in a step: one decode batch's paged
attention over every layer's own cache (blocks scattered in the pool), in GB/s of KV read, beside
the machine's memory-read ceiling measured in the same run (a torch sum over 400 MB, 1 and all threads).

    python bench/attention_dram.py [--seqs 32] [--context 190] [--layers 8] [--steps 30]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=190)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    ceiling = {threads: read_ceiling(threads) for threads in sorted({1, torch.get_num_threads()})}
    rows = {str(dtype).removeprefix("torch."): attention(dtype, args.seqs, args.context, args.layers, args.steps)
            for dtype in (torch.float32, torch.bfloat16)}
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
