"""Prefill attention on CPU: pdserve's C kernel against torch's SDPA, per call and in a long prompt's TTFT.

    python bench/prefill_attention.py [--dtype bfloat16] [--repeats 5] [--prompt 4000]

1. Per call (one layer, 8 heads of 64, 16-token blocks): each shape's prefill rows through
   kernels/csrc/paged_prefill.c and through the PyTorch path (K/V gathered out of the pool, torch's
   SDPA), alternating, median of --repeats; "C / SDPA" > 1 means SDPA is faster.
2. In the engine (the peers' 58.5M random Llama, prefix caching off): one --prompt-token prompt's
   prefill to its first token, with kernels/cpu_prefill.py's choice (default) and with every
   sequence on the C kernel (PDSERVE_PREFILL_SDPA=0), alternating, and each side's attention share.

Writes bench/results/prefill_attention_<time>.json (bench/README.md, "Long prompts' prefill attention").
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402
from kernels import cpu_prefill  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, HEAD_DIM, BLOCK = 8, 64, 16
# (sequences, new tokens each, context each): the engine's 2,048-token chunks of short prompts, then
# longer prompts, then a chunk after a cached prefix (a RAG question after its document, a second chunk)
SHAPES = ((16, 128, 128), (8, 256, 256), (4, 512, 512), (2, 1024, 1024), (1, 2048, 2048), (1, 4000, 4000),
          (1, 64, 2048), (1, 256, 2048), (1, 2000, 4000))


def _batch(dtype: torch.dtype, seqs: int, q_len: int, ctx: int):
    per = -(-ctx // BLOCK)
    kv = torch.randn(seqs * per + 1, 2, BLOCK, HEADS, HEAD_DIM, dtype=dtype)
    tables = torch.arange(seqs * per, dtype=torch.int32).view(seqs, per)
    cu = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    q = torch.randn(seqs * q_len, HEADS, HEAD_DIM, dtype=dtype)
    return lambda: kernels.paged_attention(q, kv[:, 0], kv[:, 1], tables, cu, lens, HEAD_DIM ** -0.5, q_len, ctx)


def _switched(value: str | None, fn):
    """fn() with PDSERVE_PREFILL_SDPA set to value (None: unset), the environment restored after."""
    old = os.environ.pop("PDSERVE_PREFILL_SDPA", None)
    if value is not None:
        os.environ["PDSERVE_PREFILL_SDPA"] = value
    try:
        return fn()
    finally:
        os.environ.pop("PDSERVE_PREFILL_SDPA", None)
        if old is not None:
            os.environ["PDSERVE_PREFILL_SDPA"] = old


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_call(dtype: torch.dtype, repeats: int) -> list[dict]:
    rows = []
    for seqs, q_len, ctx in SHAPES:
        call = _batch(dtype, seqs, q_len, ctx)
        c_ms, sdpa_ms = [], []
        for _ in range(repeats + 1):        # the first round warms both up and is dropped
            c_ms.append(_switched("0", lambda: _timed(call)) * 1e3)
            sdpa_ms.append(_switched("1", lambda: _timed(call)) * 1e3)
        c, s = statistics.median(c_ms[1:]), statistics.median(sdpa_ms[1:])
        rows.append({"seqs": seqs, "new_tokens": q_len, "context": ctx, "c_ms": c, "sdpa_ms": s,
                     "c_over_sdpa": c / s, "default": "sdpa" if cpu_prefill.to_library(dtype, ctx, q_len) else "c"})
        print(f"{seqs:3d} x {q_len:5d} new / {ctx:5d} ctx   C {c:8.2f} ms   SDPA {s:8.2f} ms   C / SDPA {c / s:5.2f}"
              f"   default: {rows[-1]['default']}", flush=True)
    return rows


def engine_ttft(dtype: str, prompt: int, repeats: int) -> dict:
    from bench.decode_step_profile import ModuleClock
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from pdwire.sampling_params import SamplingParams
    path = make_random_llama(os.path.join(HERE, ".cache", "llama-58m"))
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, cache=CacheConfig(kv_cache_gib=1.0, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_seqs=4)))
    clock = ModuleClock(engine.runner.model)
    rng = random.Random(0)

    def first_token() -> tuple[float, float]:
        engine.add_request(f"p{rng.random()}", [rng.randrange(100, 31000) for _ in range(prompt)],
                           SamplingParams(max_tokens=1, temperature=0.0))
        clock.seconds.clear()
        clock.enabled = True
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - start
        clock.enabled = False
        s = clock.seconds
        return wall, s["self_attn"] - s["self_attn.qkv_proj"] - s["self_attn.o_proj"]

    sides = {"default": None, "c_kernel": "0"}
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for r in range(repeats + 1):
        for side, value in sides.items():
            result = _switched(value, first_token)
            if r:
                runs[side].append(result)
    out = {}
    for side, rs in runs.items():
        wall, attn = statistics.median(w for w, _ in rs), statistics.median(a for _, a in rs)
        out[side] = {"ttft_s": wall, "attention_core_s": attn, "runs_s": [w for w, _ in rs]}
        print(f"{prompt}-token prompt, {side:8s}: first token {wall:6.2f} s, attention core {attn:6.2f} s "
              f"({attn / wall:4.0%})", flush=True)
    print(f"C kernel / default: {out['c_kernel']['ttft_s'] / out['default']['ttft_s']:.2f}x the time to first token")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=4000, help="prompt tokens for the engine's TTFT (<= 4,096)")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, AMX tiles: {cpu_prefill._amx_tiles()}")
    record = {"dtype": args.dtype, "threads": torch.get_num_threads(), "amx_tiles": cpu_prefill._amx_tiles(),
              "per_call": per_call(dtype, args.repeats)}
    if not args.skip_engine:
        record["engine"] = engine_ttft(args.dtype, args.prompt, max(1, args.repeats // 2))
    print("wrote", write_result("prefill_attention", record))


if __name__ == "__main__":
    main()
