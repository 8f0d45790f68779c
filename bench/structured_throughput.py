"""Structured-output throughput: output tokens/s of a batch of 32 with 0%, 50% and 100% of its
requests held to BENCH_SCHEMA (bench/structured_model.py), pdserve's engine beside vLLM's CPU
build on the same model, tokenizer, schema and prompts, in one run.

    python -m bench.structured_throughput                 # pdserve alone
    python -m bench.structured_throughput --vllm          # also vLLM CPU (bench/.vllm-venv)

Greedy. Free requests run output_len tokens (ignore_eos); constrained ones end when the schema's
JSON is complete (EOS), so a batch with constrained rows shrinks as they finish: the figure is
all generated tokens over the wall time, and each constrained output is checked to parse.
`--schema long` holds rows to LONG_SCHEMA instead, which no output completes: every row runs
output_len tokens, the batch stays full, and the gap to 0% is the grammar's own cost.
Fractions alternate within each repeat (the machine is shared): compare within a run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from bench.machine import write_result  # noqa: E402
from bench.serving.servers import VLLM_VENV  # noqa: E402
from bench.serving.vllm_env import vllm_env  # noqa: E402
from bench.structured_model import BENCH_SCHEMA, LONG_SCHEMA, prepare_structured_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(args, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (args.input_len,), generator=g).tolist() for _ in range(args.num_requests)]


def pdserve_runs(path: str, args) -> list[dict]:
    from engine import LLM, SamplingParams
    from pdwire.structured_output import StructuredOutput
    llm = LLM(path, dtype=args.dtype, max_num_seqs=args.num_requests, kv_cache_gib=2.0)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                 structured=StructuredOutput.json_schema(args.schema_json))
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(workload(args, args.seed - 1)[:2], [constrained, free])          # warm up, grammar compiled
    runs = []
    for r in range(args.repeats):
        for fraction in args.fractions:
            k = round(args.num_requests * fraction)
            start = time.perf_counter()
            outs = llm.generate(workload(args, args.seed + r), [constrained] * k + [free] * (args.num_requests - k))
            elapsed = time.perf_counter() - start
            tokens = [len(o.outputs[0].token_ids) for o in outs]
            valid = sum(_parses(o.outputs[0].text) for o in outs[:k])
            runs.append({"fraction": fraction, "tokens_per_s": sum(tokens) / elapsed,
                         "constrained_mean_len": sum(tokens[:k]) / max(k, 1), "valid": valid, "constrained": k,
                         "stopped": sum(o.outputs[0].finish_reason == "stop" for o in outs[:k])})
            print("pdserve", runs[-1], flush=True)
    return runs


def vllm_runs(path: str, args) -> list[dict] | None:
    if not os.path.exists(os.path.join(VLLM_VENV, "bin", "python")):
        print("vLLM CPU is not installed (python -m bench.serving install)")
        return None
    env = vllm_env(2)
    cmd = [os.path.join(VLLM_VENV, "bin", "python"), os.path.join(HERE, "vllm_structured.py"), path, args.dtype,
           str(args.num_requests), str(args.input_len), str(args.output_len), str(args.seed), str(args.repeats),
           ",".join(map(str, args.fractions)), json.dumps(args.schema_json)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    runs = [json.loads(line.split("=", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("VLLM_STRUCTURED=")]
    if len(runs) == args.repeats * len(args.fractions):
        return runs
    print("vLLM run failed:\n" + proc.stdout[-2000:] + proc.stderr[-4000:])
    return None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def summary(runs: list[dict]) -> dict[str, dict]:
    out = {}
    for fraction in sorted({r["fraction"] for r in runs}):
        mine = [r for r in runs if r["fraction"] == fraction]
        out[f"{fraction:.0%}"] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in mine),
                                  "tokens_per_s": [round(r["tokens_per_s"], 1) for r in mine],
                                  "constrained_mean_len": statistics.mean(r["constrained_mean_len"] for r in mine),
                                  "valid": f"{sum(r['valid'] for r in mine)}/{sum(r['constrained'] for r in mine)}",
                                  "ended_stop": sum(r["stopped"] for r in mine)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--fractions", type=lambda s: [float(f) for f in s.split(",")], default=[0.0, 0.5, 1.0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build (bench/.vllm-venv)")
    ap.add_argument("--schema", choices=["bench", "long"], default="bench")
    args = ap.parse_args()
    args.schema_json = LONG_SCHEMA if args.schema == "long" else BENCH_SCHEMA
    path = prepare_structured_model(os.path.join(HERE, ".cache"))
    results = {"pdserve": summary(pdserve_runs(path, args))}
    if args.vllm and (runs := vllm_runs(path, args)) is not None:
        results["vllm_cpu"] = summary(runs)
    for system, by_fraction in results.items():
        for fraction, res in by_fraction.items():
            print(f"{system:8s} {fraction:>4s} constrained: {res['tokens_per_s_median']:7.1f} tok/s "
                  f"(runs {res['tokens_per_s']}), constrained outputs {res['constrained_mean_len']:.0f} tokens, "
                  f"valid JSON {res['valid']} ({res['ended_stop']} ended by the grammar)")
    write_result("structured_throughput", {"args": vars(args), "results": results}, tag=args.schema)


if __name__ == "__main__":
    main()
