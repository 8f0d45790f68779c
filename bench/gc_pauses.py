"""What Python's cyclic garbage collector costs pdserve's offline engine, with and without
gc.freeze() after start-up (engine/heap.py; vLLM freezes its engine's heap the same way).

    python bench/gc_pauses.py                       # float32, 32 x 128/128, 3 runs a side
    python bench/gc_pauses.py --dtype bfloat16 --repeats 4

The engine and workload of bench/engine_throughput.py (the peers' random Llama, fresh prompts each
run). The two sides alternate run by run in one process: `thawed` (gc.unfreeze(): every tracked
object, the engine's included, is traversed by each full collection) and `frozen` (gc.collect();
gc.freeze(): only objects made since are). Both start a run right after a full collection. Per
side: output tokens/s, collections per generation (count, total and longest ms), engine step
times (p50 / p99 / max ms), and what one full collection (gc.collect()) costs right after a run.
Writes bench/results/gc_pauses_<dtype>_<time>.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first
from bench.engine_throughput import HERE, pdserve_runner, workload_args  # noqa: E402  (sets OMP_WAIT_POLICY before torch loads)
from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402

SIDES = ("thawed", "frozen")


class Clock:
    """Collections (generation, seconds) and engine steps (seconds) while a run is on."""

    def __init__(self) -> None:
        self.collections: list[tuple[int, float]] = []
        self.steps: list[float] = []
        self.full_collection_s = 0.0      # gc.collect() right after the run
        self._started = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections.append((info["generation"], time.perf_counter() - self._started))

    def timed(self, step):
        def run():
            start = time.perf_counter()
            out = step()
            self.steps.append(time.perf_counter() - start)
            return out
        return run


def set_side(side: str) -> None:
    gc.unfreeze()
    gc.collect()
    if side == "frozen":
        gc.freeze()


def summary(rates: list[float], clocks: list[Clock]) -> dict:
    """One side's runs: tokens/s, collections per generation and step-time percentiles."""
    steps = sorted(s * 1e3 for c in clocks for s in c.steps)
    out = {"tokens_per_s": rates, "tokens_per_s_median": statistics.median(rates),
           "step_ms": {"n": len(steps), "p50": steps[len(steps) // 2], "p99": steps[int(len(steps) * 0.99)],
                       "max": steps[-1]},
           "full_collection_ms": [c.full_collection_s * 1e3 for c in clocks]}
    for gen in range(3):
        ms = [d * 1e3 for c in clocks for g, d in c.collections if g == gen]
        out[f"gen{gen}"] = {"count": len(ms), "ms_total": sum(ms), "ms_max": max(ms, default=0.0)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side, alternating")
    args = ap.parse_args()
    args.temperature = 0.0
    run = pdserve_runner(make_random_llama(os.path.join(HERE, ".cache", "llama-58m")), args)
    engine = run.llm.engine
    set_side("thawed")
    tracked = len(gc.get_objects())
    results: dict[str, tuple[list[float], list[Clock]]] = {side: ([], []) for side in SIDES}
    step = engine.step
    for r in range(args.repeats):
        for i, side in enumerate(SIDES):
            set_side(side)
            clock = Clock()
            engine.step = clock.timed(step)
            gc.callbacks.append(clock.on_gc)
            results[side][0].append(run(r * len(SIDES) + i))       # fresh prompts: no prefix-cache hits
            gc.callbacks.remove(clock.on_gc)
            start = time.perf_counter()
            gc.collect()                    # what one full collection costs this side now
            clock.full_collection_s = time.perf_counter() - start
            results[side][1].append(clock)
    report = {side: summary(*results[side]) for side in SIDES}
    print(f"{args.dtype}, {args.num_requests} x {args.input_len}/{args.output_len}, {args.repeats} runs a side "
          f"alternating; {tracked:,} objects tracked after warm-up; load average {os.getloadavg()[0]:.2f} at the end")
    for side, r in report.items():
        s = r["step_ms"]
        gens = "; ".join(f"gen{g} {r[f'gen{g}']['count']} x, {r[f'gen{g}']['ms_total']:.1f} ms "
                         f"(max {r[f'gen{g}']['ms_max']:.1f})" for g in range(3))
        print(f"  {side:7s} {r['tokens_per_s_median']:7.1f} tok/s (runs: "
              + ", ".join(f"{x:.0f}" for x in r["tokens_per_s"])
              + f"); steps p50 {s['p50']:.1f} p99 {s['p99']:.1f} max {s['max']:.1f} ms; {gens}; a full "
              f"collection after a run: {statistics.median(r['full_collection_ms']):.1f} ms")
    paired = [f / t for f, t in zip(report["frozen"]["tokens_per_s"], report["thawed"]["tokens_per_s"])]
    print("  frozen / thawed, run by run: " + ", ".join(f"{x:.3f}" for x in paired))
    print("wrote", write_result("gc_pauses", {"args": vars(args), "tracked_after_warmup": tracked,
                                              "paired": paired, **report}, tag=args.dtype))


if __name__ == "__main__":
    main()
