"""TTFT tuning: one system restarted per setting, the same workload (RAG by default) at one offered
rate; TTFT P50/P99 against throughput for each setting.

  prefill knobs (default, any system): the per-step token budget `max_num_batched_tokens` (the
      prefill chunk size) and `max_num_seqs`
  routing knobs (`--routing`, pdserve-1p1d): --local-prefill-tokens, --decode-load-weight and the
      chunk size, every combination; best_routing() names the setting that meets the TTFT SLO
      (and the TPOT SLO) for >= 90% of requests at the highest goodput
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

from bench.serving import record as rec
from bench.serving.compare import SweepSpec, run_system
from bench.serving.servers import available

ROUTED = "pdserve-1p1d"
ATTAINMENT = 0.9            # DistServe's bar: the share of requests meeting both SLOs


def run_tuning(system: str, spec: SweepSpec, grid: list[tuple[int, int]], model: str, vocab: list[str]) -> dict:
    """`grid`: (max_num_batched_tokens, max_num_seqs) pairs; spec.rates holds the one rate."""
    result = _header(system, spec, model, "serving_tuning")
    for tokens, seqs in grid:
        knobs = dataclasses.replace(spec.knobs, max_num_batched_tokens=tokens, max_num_seqs=seqs)
        print(f"[tune] {system}: max_num_batched_tokens {tokens}, max_num_seqs {seqs}", flush=True)
        result["configs"].append(_config(system, spec, knobs, model, vocab)
                                 | {"max_num_batched_tokens": tokens, "max_num_seqs": seqs})
    result["configs"] = [c for c in result["configs"] if c["metrics"]]
    return result


class RoutingSetting(NamedTuple):
    local_prefill_tokens: int
    decode_load_weight: float
    max_num_batched_tokens: int     # the prefill chunk size, on both node kinds

    def flags(self) -> tuple[str, ...]:
        return ("--routing", "cost", "--local-prefill-tokens", str(self.local_prefill_tokens),
                "--decode-load-weight", str(self.decode_load_weight))


def routing_grid(thresholds: list[int], weights: list[float], chunks: list[int]) -> list[RoutingSetting]:
    return [RoutingSetting(*combo) for combo in itertools.product(thresholds, weights, chunks)]


def run_routing_tuning(spec: SweepSpec, grid: list[RoutingSetting], model: str, vocab: list[str]) -> dict:
    """pdserve-1p1d once per setting of `grid`; spec.rates holds the one rate."""
    result = _header(ROUTED, spec, model, "serving_routing_tuning")
    for setting in grid:
        print(f"[tune] {ROUTED}: {setting}", flush=True)
        knobs = dataclasses.replace(spec.knobs, max_num_batched_tokens=setting.max_num_batched_tokens)
        routed = dataclasses.replace(spec, pdserve_flags=spec.pdserve_flags + setting.flags())
        result["configs"].append(_config(ROUTED, routed, knobs, model, vocab) | setting._asdict())
    result["configs"] = [c for c in result["configs"] if c["metrics"]]
    result["best"] = best_routing(result["configs"])
    return result


def best_routing(configs: list[dict]) -> dict | None:
    """The setting whose requests met the SLOs (>= 90%) at the highest goodput; None if none did."""
    met = [c for c in configs if c["metrics"]["slo_attainment"] >= ATTAINMENT]
    if not met:
        return None
    best = max(met, key=lambda c: (c["metrics"]["goodput"], -c["metrics"]["ttft"]["p50"]))
    return {k: best[k] for k in RoutingSetting._fields}


def _header(system: str, spec: SweepSpec, model: str, bench: str) -> dict:
    why_not = available(system)
    if why_not:
        raise SystemExit(f"{system}: {why_not}")
    return rec.header(bench, model) | {"system": system, "workload_name": spec.workload, "rate": spec.rates[0],
                                       "sweep": dataclasses.asdict(spec), "configs": []}


def _config(system: str, spec: SweepSpec, knobs, model: str, vocab: list[str]) -> dict:
    out = run_system(system, spec, model, vocab, knobs)
    point = out["points"][0] if out["points"] else None
    return {"status": out["status"], "server": out["server"], "metrics": point and point["metrics"],
            "prometheus": point and point["prometheus"], "point": point}
