"""How fast this machine runs the model's linears right now: a fixed reference workload, recorded
beside every profile (pdplan/profiler.py) and every measured point (bench/simulate/measure.py), so
that a validation can price the simulated steps at the speed the machine had when the point ran
(bench/simulate/validate.py --probe-speed).

Why: the benchmark host is a shared VM whose speed drifts. Two profiles made back to back on a
quiet machine (bench/profiles/cpu_1core_llama58m_quiet8a.json and ..._quiet8b.json, 5 minutes
apart) disagreed by 33% on every prefill step, with no steal in /proc/stat.

The workload: the model's own linears (qkv, o_proj, gate_up, down of every layer, and lm_head),
random weights of its shapes read from its config.json, packed by the engine's own path
(engine/packed_linear.py pack_linears: the kernel a node runs):

    prefill_s   one pass of 512 rows through every layer's linears              (compute-bound)
    decode_s    6 passes of 32 rows through every layer's linears and lm_head   (weights from memory)

each the median of 3 repeats. The 58M benchmark model, float32, on one core of the benchmark host
(2026-12-03, five runs minutes apart): prefill_s 0.25-0.35 s, decode_s 0.20-0.26 s (the drift this
probe is for); the probe ~2.5 s with its weights' making and packing, and a pinned process
(probe_cores) 7-10 s with its imports.

    python -m pdplan.speed_probe --model DIR --dtype float32     # prints one JSON object
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the checkout: `python -m` runs from it


@dataclass(frozen=True, slots=True)
class ProbeShape:
    """The reference workload (the module docstring); change it and old records no longer compare."""
    prefill_rows: int = 512
    decode_rows: int = 32
    decode_passes: int = 6
    repeats: int = 3


@dataclass(frozen=True, slots=True)
class Speed:
    """The probe's two figures, in seconds (higher: a slower machine)."""
    prefill_s: float
    decode_s: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, record) -> "Speed | None":
        """A recorded probe (a dict), or None where it failed (its error string) or is missing."""
        return cls(float(record["prefill_s"]), float(record["decode_s"])) if isinstance(record, dict) else None

    @classmethod
    def mean(cls, speeds: list["Speed"]) -> "Speed":
        return cls(statistics.fmean(s.prefill_s for s in speeds), statistics.fmean(s.decode_s for s in speeds))


def speed_ratio(now: Speed, then: Speed) -> float:
    """The geometric mean of now / then over the two figures: > 1 when the machine is slower now."""
    return math.sqrt(now.prefill_s / then.prefill_s * now.decode_s / then.decode_s)


def probe(cfg, shape: ProbeShape = ProbeShape()) -> Speed:
    """Times the reference workload for the model `cfg` (an engine ModelConfig) on the CPU, in this
    process: on whatever cores and threads it has (a node's: one core, one thread)."""
    import torch
    with torch.random.fork_rng(devices=[]):             # the caller's random state as it was
        torch.manual_seed(0)
        linears = _linears(cfg)
        big, small = _inputs(cfg, shape.prefill_rows), _inputs(cfg, shape.decode_rows)
    with torch.inference_mode():
        _run(linears, small, head=True)                 # warm-up: every weight read once, kernels loaded
        prefill = _median(lambda: _run(linears, big, head=False), shape.repeats)
        decode = _median(lambda: [_run(linears, small, head=True) for _ in range(shape.decode_passes)], shape.repeats)
    return Speed(prefill, decode)


def probe_model(path: str, dtype: str = "auto", shape: ProbeShape = ProbeShape()) -> Speed:
    """probe() for the model in the local folder `path` (its config.json), at `dtype` as a CPU node runs it."""
    from engine.config import ModelConfig
    return probe(ModelConfig.from_pretrained(path, dtype), shape)


def probe_cores(path: str, dtype: str, cores, timeout_s: float = 60.0) -> dict[int, Speed | str]:
    """core -> the probe run on it in a fresh process pinned there with one thread (as a node runs),
    one core after another (two at once would share the L3 and the memory bus); a probe that fails or
    outlives timeout_s gives its error instead."""
    return {core: _probe_on(core, path, dtype, timeout_s) for core in sorted(cores)}


def record(speeds: dict[int, Speed | str]) -> dict[str, dict | str]:
    """probe_cores' answer as JSON: core (a string) -> the figures, or the error."""
    return {str(core): s.to_dict() if isinstance(s, Speed) else s for core, s in speeds.items()}


def _probe_on(core: int, path: str, dtype: str, timeout_s: float) -> Speed | str:
    argv = ["taskset", "-c", str(core), sys.executable, "-m", "pdplan.speed_probe", "--model", path, "--dtype", dtype]
    try:
        done = subprocess.run(argv, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s"
    except OSError as e:
        return f"not started: {e}"
    if done.returncode:
        return f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
    try:
        speed = Speed.read(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, KeyError, IndexError) as e:
        return f"unreadable output: {e!r}"
    return speed or f"unreadable output: {done.stdout.strip()[-200:]!r}"


def _linears(cfg):
    """The model's linears, random weights, packed as a node packs them: [(attention, mlp) per layer], lm_head."""
    from torch import nn
    from engine.model import MLP, Attention
    from engine.packed_linear import pack_linears
    model = nn.ModuleDict({"layers": nn.ModuleList(nn.ModuleList([Attention(cfg), MLP(cfg)]) for _ in range(cfg.num_layers)),
                           "lm_head": nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype)})
    pack_linears(model)
    return model


def _inputs(cfg, rows: int) -> tuple:
    """Random inputs of each linear's width: ([rows, hidden], [rows, heads * head_dim], [rows, intermediate])."""
    import torch
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    return tuple(torch.randn(rows, w).to(cfg.dtype) for w in widths)


def _run(model, inputs: tuple, head: bool) -> None:
    hidden, heads, inter = inputs
    for attn, mlp in model["layers"]:
        attn.qkv_proj(hidden)
        attn.o_proj(heads)
        mlp.gate_up_proj(hidden)
        mlp.down_proj(inter)
    if head:
        model["lm_head"](hidden)


def _median(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdplan.speed_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face folder (its config.json)")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16, as a node's --dtype")
    args = ap.parse_args(argv)
    print(json.dumps(probe_model(args.model, args.dtype).to_dict()))


if __name__ == "__main__":
    main()
