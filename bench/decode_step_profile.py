"""Where a decode step's time goes, bfloat16 beside float32, module by module.

    .venv/bin/python bench/decode_step_profile.py [--num-seqs 32] [--steps 20] [--bf16-onednn] [--f32-onednn]

The peers' 58.5M random Llama (bench/random_model.py), `--num-seqs` sequences of 128 random
prompt tokens prefilled, then `--steps` decode steps timed with forward hooks on the model's
modules (summed over layers), alternating dtypes step block by step block; then one torch
profiler pass per dtype lists the top operators by self CPU time. --bf16-onednn adds a third
side: bfloat16 with its linears on oneDNN (PDSERVE_BF16_GEMM=0) instead of pdserve's GEMM (AMX's
where the CPU has AMX, else vdpbf16ps');
--f32-onednn the same for float32 (PDSERVE_F32_GEMM=0). Shares matter more than
milliseconds on a shared machine. The hooks send every layer through its modules
(engine/direct_layers.py runs a layer directly only where nothing hooks it), so the steps timed
here are the module path's (`bench/direct_layers.py` compares the two). Writes bench/results/decode_step_profile_<time>.json.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict

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
PARTS = ("embed_tokens", "input_layernorm", "self_attn.qkv_proj", "self_attn", "self_attn.o_proj",
         "post_attention_layernorm", "mlp.gate_up_proj", "mlp", "mlp.down_proj", "norm", "lm_head")


class ModuleClock:
    """Seconds spent in each PARTS module (summed over layers) while enabled."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        for name, module in model.named_modules():
            part = name.split(".", 2)[-1] if name.startswith("layers.") else name
            if part in PARTS:
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(lambda m, i, o, part=part: self._stop(m, part))

    def _start(self, module, inputs) -> None:
        module._clock_start = time.perf_counter()

    def _stop(self, module, part: str) -> None:
        if self.enabled:
            self.seconds[part] += time.perf_counter() - module._clock_start


def decoding_engine(path: str, dtype: str, num_seqs: int, gemm: bool = True) -> LLMEngine:
    """An engine with num_seqs sequences past their prefill, decoding on pdserve's default linears
    for this CPU (bf16: AMX's GEMM where it has AMX, else vdpbf16ps'); gemm False: packed for oneDNN,
    as PDSERVE_BF16_GEMM=0 / PDSERVE_F32_GEMM=0 do."""
    choose_linears(gemm)
    engine = LLMEngine(EngineConfig(model=path, dtype=dtype, cache=CacheConfig(kv_cache_gib=0.5),
                                    scheduler=SchedulerConfig(max_num_seqs=num_seqs)))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [rng.randrange(100, 31000) for _ in range(128)], params)
    for _ in range(4):                  # prefill (one step at the default token budget), warm up
        engine.step()
    return engine


def breakdown(engine: LLMEngine, clock: ModuleClock, steps: int) -> dict[str, float]:
    """Milliseconds per decode step: the step, and each part (attention core and MLP activation
    are their module less its linears; `outside model` is the step less the forward)."""
    clock.seconds.clear()
    clock.enabled = True
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    clock.enabled = False
    ms = {part: s / steps * 1e3 for part, s in clock.seconds.items()}
    ms["attention core (rope, kv store, paged attention)"] = \
        ms.pop("self_attn") - ms["self_attn.qkv_proj"] - ms["self_attn.o_proj"]
    ms["mlp activation (silu and mul)"] = ms.pop("mlp") - ms["mlp.gate_up_proj"] - ms["mlp.down_proj"]
    ms["step (median)"] = statistics.median(walls) * 1e3
    ms["outside model (inputs, sampling, scheduling)"] = sum(walls) / steps * 1e3 - sum(
        v for k, v in ms.items() if k != "step (median)")
    return ms


def top_ops(engine: LLMEngine, steps: int = 5, n: int = 12) -> list[tuple[str, float]]:
    """The n operators with the most self CPU time over steps decode steps, in ms per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, e.self_cpu_time_total / steps / 1e3) for e in events]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="decode steps per block; 3 blocks per dtype")
    ap.add_argument("--bf16-onednn", action="store_true", help="also bf16 with oneDNN's linears")
    ap.add_argument("--f32-onednn", action="store_true", help="also float32 with oneDNN's linears")
    args = ap.parse_args()
    path = make_random_llama(os.path.join(HERE, ".cache", "llama-58m"))
    sides = {}
    choices = (("float32", "float32", True), ("bfloat16", "bfloat16", True),
               ("bf16-onednn", "bfloat16", False) if args.bf16_onednn else None,
               ("f32-onednn", "float32", False) if args.f32_onednn else None)
    for label, dtype, gemm in filter(None, choices):
        engine = decoding_engine(path, dtype, args.num_seqs, gemm)
        sides[label] = (engine, ModuleClock(engine.runner.model))
    blocks: dict[str, list[dict[str, float]]] = {d: [] for d in sides}
    for _ in range(3):                  # alternating blocks of steps: both dtypes see the same load
        for dtype, (engine, clock) in sides.items():
            blocks[dtype].append(breakdown(engine, clock, args.steps))
    result = {}
    for dtype, runs in blocks.items():
        result[dtype] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result[dtype + "_top_ops"] = top_ops(sides[dtype][0])
    parts, others = list(result["float32"]), [side for side in sides if side != "float32"]
    print(f"{'ms per decode step, ' + str(args.num_seqs) + ' seqs':52s} {'float32':>8s}"
          + "".join(f" {side:>11s}  ratio" for side in others))
    for part in parts:
        f = result["float32"][part]
        print(f"{part:52s} {f:8.2f}" + "".join(
            f" {result[side][part]:11.2f}  {result[side][part] / f if f else float('nan'):5.2f}" for side in others))
    for dtype in sides:
        print(f"top ops, {dtype} (self CPU ms per step):")
        for name, ms in result[dtype + "_top_ops"]:
            print(f"  {name:48s} {ms:7.2f}")
    print(f"load average {os.getloadavg()}")
    print("wrote", write_result("decode_step_profile", {"num_seqs": args.num_seqs, "steps": args.steps,
                                                        "load_avg": os.getloadavg(), **result}))


if __name__ == "__main__":
    main()
