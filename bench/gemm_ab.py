"""pdserve's own GEMM against oneDNN's packed linears inside the engine: whole runs of
engine_throughput.py's workload (32 requests, 128 prompt / 128 output tokens, greedy), the two
engines taking turns run by run in one process (which goes first alternating: the first of a pair
measured slower here, either way), each run's prefill and decode steps timed apart. Each engine
first does --warmup untimed runs of the same workload on prompts of their own (kernel builds and
loads, first-touch of its pools and buffers, OpenMP's threads), so the first timed run is not
also the first run.

    python bench/gemm_ab.py [--dtype float32] [--repeats 5] [--warmup 1] [--vdpbf16ps | --avx2-f32]

The same engine either way but for its linears (PDSERVE_F32_GEMM / PDSERVE_BF16_GEMM set to 0
for the oneDNN side when it is built; the GEMM side is pdserve's default for the CPU: for bf16
AMX's GEMM where the CPU has AMX, else vdpbf16ps', else AVX2's, and --vdpbf16ps asks for the second on
AMX; --avx2-f32 asks for AVX2's float32 GEMM, a default nowhere). On an AVX2-only CPU oneDNN has no
bf16, so there the "oneDNN" side of a bf16 run is nn.Linear: PyTorch's generic path. Writes bench/results/gemm_ab_<time>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")    # as engine/__init__.py, but before anything loads torch

import torch  # noqa: E402

from bench.linear_choice import choose_linears  # noqa: E402
from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from pdwire.sampling_params import SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REQUESTS, PROMPT, OUTPUT = 32, 128, 128
WARMUP_SEED = 1 << 20       # warm-up runs' prompts are seeded from here: never a timed run's (seeded by repeat)


def engine(path: str, dtype: str, gemm: bool, vdpbf16ps: bool = False, avx2_f32: bool = False) -> LLMEngine:
    """gemm: pdserve's default GEMM for the dtype on this CPU (bench/linear_choice.py); else oneDNN's."""
    choose_linears(gemm, vdpbf16ps, avx2_f32)
    return LLMEngine(EngineConfig(model=path, dtype=dtype, cache=CacheConfig(kv_cache_gib=2.0),
                                  scheduler=SchedulerConfig(max_num_seqs=REQUESTS, max_num_batched_tokens=2048)))


def timed_run(eng: LLMEngine, repeat: int) -> dict[str, float]:
    """One run on fresh prompts: seconds in all, in prefill steps (any step with a prompt
    chunk: the first two here) and in the decode steps after them; output tokens/s."""
    g = torch.Generator().manual_seed(repeat)
    params = SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
    for i in range(REQUESTS):
        eng.add_request(f"r{repeat}-{i}", torch.randint(10, 30000, (PROMPT,), generator=g).tolist(), params)
    steps = []
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - start)
    prefill_steps = -(-REQUESTS * PROMPT // 2048)
    total = sum(steps)
    return {"tok_s": REQUESTS * OUTPUT / total, "total_s": total, "prefill_s": sum(steps[:prefill_steps]),
            "decode_ms_per_step": sum(steps[prefill_steps:]) / len(steps[prefill_steps:]) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per engine before the timed ones")
    ap.add_argument("--vdpbf16ps", action="store_true", help="bf16: the vdpbf16ps GEMM even where AMX's is the default")
    ap.add_argument("--avx2-f32", action="store_true", help="float32: the AVX2 GEMM (kernels/gemm_avx2.py), not a default")
    args = ap.parse_args()
    path = make_random_llama(os.path.join(HERE, ".cache", "llama-58m"))
    engines = {"pdserve GEMM": engine(path, args.dtype, True, args.vdpbf16ps, args.avx2_f32), "oneDNN": engine(path, args.dtype, False)}
    print({side: type(e.runner.model.lm_head).__name__ for side, e in engines.items()})
    for side, eng in engines.items():
        for w in range(args.warmup):
            timed_run(eng, WARMUP_SEED + w)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in engines}
    load = [os.getloadavg()[0]]
    for repeat in range(args.repeats):
        order = list(engines.items())
        for side, eng in order if repeat % 2 == 0 else order[::-1]:    # who goes first takes turns too
            runs[side].append(timed_run(eng, repeat))
            r = runs[side][-1]
            print(f"  {side:12s} {r['tok_s']:6.0f} tok/s  prefill {r['prefill_s'] * 1e3:5.0f} ms  "
                  f"decode {r['decode_ms_per_step']:5.2f} ms/step", flush=True)
    load.append(os.getloadavg()[0])
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    for side, m in medians.items():
        print(f"{side:12s} median {m['tok_s']:6.0f} tok/s  prefill {m['prefill_s'] * 1e3:5.0f} ms  "
              f"decode {m['decode_ms_per_step']:5.2f} ms/step")
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(*runs.values())]      # per repeat, whatever the order
    print(f"GEMM / oneDNN tok/s, run by run: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f}); load average {load[0]:.1f} -> {load[1]:.1f}")
    print("wrote", write_result("gemm_ab", {"dtype": args.dtype, "warmup": args.warmup, "runs": runs, "medians": medians, "load_avg": load}))


if __name__ == "__main__":
    main()
