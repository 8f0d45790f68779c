"""TTFT tuning: one system restarted per prefill setting (per-step token budget
`max_num_batched_tokens`, i.e. the prefill chunk size, and `max_num_seqs`), the same workload
(RAG by default) at one offered rate; TTFT P50/P99 against throughput for each setting."""
from __future__ import annotations

import dataclasses

from bench.serving import record as rec
from bench.serving.compare import SweepSpec, run_system
from bench.serving.servers import available


def run_tuning(system: str, spec: SweepSpec, grid: list[tuple[int, int]], model: str, vocab: list[str]) -> dict:
    """`grid`: (max_num_batched_tokens, max_num_seqs) pairs; spec.rates holds the one rate."""
    why_not = available(system)
    if why_not:
        raise SystemExit(f"{system}: {why_not}")
    result = rec.header("serving_tuning", model) | {
        "system": system, "workload_name": spec.workload, "rate": spec.rates[0], "sweep": dataclasses.asdict(spec),
        "configs": []}
    for tokens, seqs in grid:
        knobs = dataclasses.replace(spec.knobs, max_num_batched_tokens=tokens, max_num_seqs=seqs)
        print(f"[tune] {system}: max_num_batched_tokens {tokens}, max_num_seqs {seqs}", flush=True)
        out = run_system(system, spec, model, vocab, knobs)
        point = out["points"][0] if out["points"] else None
        result["configs"].append({"max_num_batched_tokens": tokens, "max_num_seqs": seqs, "status": out["status"],
                                  "server": out["server"], "metrics": point and point["metrics"],
                                  "prometheus": point and point["prometheus"], "point": point})
    result["configs"] = [c for c in result["configs"] if c["metrics"]]
    return result
