"""Sampler microbenchmark: what one decode step's sampling costs, by setting, against the
straightforward PyTorch way (a full sort per top-k/top-p/min-p, `torch.multinomial` per draw).

    python bench/sampler_bench.py [--rows 32] [--vocab 32000]

Logits are random normal times --scale values: 1 is flat (a random model: top-p needs most of
the vocabulary, so the full sort runs), 5 is peaked like a trained model's. Writes JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import write_result  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.logit_filter import _sorted_filter  # noqa: E402
from engine.sampler import Sampler, SamplingRow, _filter  # noqa: E402

SETTINGS = {"temperature only": {}, "top_k 50": dict(top_k=50), "top_p 0.9": dict(top_p=0.9),
            "top_k 50 + top_p 0.9": dict(top_k=50, top_p=0.9), "min_p 0.05": dict(min_p=0.05)}


def ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    sampler, results = Sampler(), []
    print(f"{args.rows} rows x {args.vocab} tokens, {torch.get_num_threads()} threads; ms per step (median of 20)")
    print(f"{'setting':24s} {'scale':>5s} {'pdserve filter':>14s} {'full sort':>9s} {'pdserve step':>12s}")
    for scale in (1.0, 5.0):
        logits = torch.randn(args.rows, args.vocab, generator=g) * scale
        for name, extra in SETTINGS.items():
            rows = [SamplingRow(SamplingParams(temperature=0.8, **extra), [], [], None)] * args.rows
            params = rows[0].params
            top_k = torch.full((args.rows,), min(params.top_k, args.vocab) if params.top_k > 0 else args.vocab)
            top_p, min_p = torch.full((args.rows,), params.top_p), torch.full((args.rows,), params.min_p)
            r = dict(setting=name, scale=scale, filter_ms=ms(lambda: _filter(logits, rows)),
                     full_sort_ms=ms(lambda: _sorted_filter(logits, top_k, top_p, min_p)) if extra else None,
                     step_ms=ms(lambda: sampler(logits, rows)))
            results.append(r)
            sort = f"{r['full_sort_ms']:9.2f}" if r["full_sort_ms"] is not None else f"{'-':>9s}"
            print(f"{name:24s} {scale:5.1f} {r['filter_ms']:14.2f} {sort} {r['step_ms']:12.2f}")
    probs = torch.softmax(torch.randn(args.rows, args.vocab, generator=g), dim=-1)
    multinomial = ms(lambda: [torch.multinomial(probs[i], 1, generator=g) for i in range(args.rows)])
    print(f"draws: torch.multinomial per row {multinomial:.2f} ms for the batch (pdserve: one uniform "
          f"number per row through the CDF, inside 'pdserve step' above)")
    print("wrote", write_result("sampler_bench", dict(args=vars(args), results=results, multinomial_ms=multinomial)))


if __name__ == "__main__":
    main()
