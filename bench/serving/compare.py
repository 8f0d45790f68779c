"""Side by side: each system is started, warmed up, swept over request rates on the same
workload, and stopped; one JSON holds everything (record.py), plots follow (plots.py).

For each system in turn:
  1. start the server (servers.running), wait for /health and /v1/models
  2. warm up with two short requests (not measured)
  3. for each offered rate: the workload drawn with seed + rate index (so the prefix caches
     never see a previous point's prompts), sent by the load generator, summarized
  4. stop the server (its whole process group), also on error or Ctrl-C
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import asdict, dataclass, replace

from bench.serving import record as rec
from bench.serving.loadgen import LoadSpec, RunResult, run_load
from bench.serving.metrics import SLO, distserve_goodput, summarize
from bench.serving.servers import Knobs, ServerFailed, available, running, server_spec
from bench.serving.workloads import WorkloadSpec, generate, summary


@dataclass(frozen=True, slots=True)
class SweepSpec:
    systems: tuple[str, ...]
    workload: str
    num_requests: int               # per rate point
    rates: tuple[float, ...]        # offered requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    deadline_s: float = 300.0       # per rate point
    output_cap: int | None = None
    slo: SLO = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    knobs: Knobs = Knobs()
    pdserve_flags: tuple[str, ...] = ()     # extra flags for both pdserve servers
    temperature: float = 0.0                # 0: greedy requests; else sampled at it
    repeat: int = 1                         # runs of the whole system list, alternating: the
                                            # k-th run's results are under "name#k" (k > 1)

    def workload_at(self, point: int) -> WorkloadSpec:
        return WorkloadSpec(self.workload, self.num_requests, self.seed + point,
                            self.knobs.max_model_len, output_cap=self.output_cap)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sweep(spec: SweepSpec, model: str, vocab: list[str], bench: str = "serving_compare") -> str:
    """Run every system; returns the path of the result JSON."""
    result = rec.header(bench, model) | {
        "sweep": asdict(spec), "workload": [_workload_summary(spec, i) for i in range(len(spec.rates))],
        "systems": {}}
    path = None
    for k in range(1, spec.repeat + 1):
        for name in spec.systems:
            key = name if k == 1 else f"{name}#{k}"
            why_not = available(name)
            if why_not:
                print(f"[{name}] skipped: {why_not}")
                result["systems"][key] = {"status": f"skipped: {why_not}"}
                continue
            result["systems"][key] = run_system(name, spec, model, vocab)
            path = _save(result, bench, path)    # after each system: a crash later keeps what ran
    return _save(result, bench, path)


def run_system(name: str, spec: SweepSpec, model: str, vocab: list[str], knobs: Knobs | None = None) -> dict:
    server = server_spec(name, model, free_port(), knobs or spec.knobs)
    if name.startswith("pdserve") and spec.pdserve_flags:
        server = replace(server, argv=server.argv + spec.pdserve_flags)
    out = {"status": "ok", "server": server.record(), "knobs": asdict(knobs or spec.knobs), "points": []}
    log = os.path.join(rec.RESULTS, "logs", f"{name}_{int(time.time())}.log")
    t0 = time.perf_counter()
    try:
        with running(server, log) as endpoint:
            endpoint = replace(endpoint, temperature=spec.temperature)
            out["startup_s"] = round(time.perf_counter() - t0, 1)
            print(f"[{name}] up in {out['startup_s']} s", flush=True)
            asyncio.run(run_load(endpoint, _warmup(spec), vocab, LoadSpec(float("inf"), deadline_s=120), "warm-up"))
            for i, rate in enumerate(spec.rates):
                out["points"].append(_point(endpoint, spec, i, rate, vocab, name))
    except (ServerFailed, OSError) as err:
        out["status"] = f"failed: {err}"[:4000]
        print(f"[{name}] {out['status'][:500]}")
    out["log"] = log
    out["distserve_goodput"] = distserve_goodput(
        [(p["rate"], p["metrics"]["slo_attainment"]) for p in out["points"]])
    return out


def _point(endpoint, spec: SweepSpec, i: int, rate: float, vocab: list[str], name: str) -> dict:
    requests = generate(spec.workload_at(i))
    load = LoadSpec(rate, spec.burstiness, spec.max_concurrency, spec.seed + i, spec.deadline_s)
    load_before = os.getloadavg()
    run = asyncio.run(run_load(endpoint, requests, vocab, load, f"{name} @ {rate} req/s"))
    m = summarize(run.records, run.duration_s, rate, run.achieved_rate, spec.slo)
    shipped = kv_shipped(run.prometheus, m.completed)
    print(f"[{name}] rate {rate:g}: {m.completed}/{m.num_sent} done, sent at {run.achieved_rate:.2f} req/s "
          f"(schedule {run.scheduled_rate:.2f}), {m.request_throughput:.2f} req/s, "
          f"{m.output_throughput:.0f} tok/s, TTFT p50 {m.ttft.p50:.0f} / p99 {m.ttft.p99:.0f} ms, "
          f"TPOT p50 {m.tpot.p50:.1f} ms, norm. latency {m.normalized_latency_s * 1000:.1f} ms/token, "
          f"SLO attainment {m.slo_attainment:.0%}, KV shipped {shipped['kv_bytes_per_request'] / 2**20:.2f} MiB/request, "
          f"prefills local / remote {shipped['local_prefills']:.0f} / {shipped['remote_prefills']:.0f}", flush=True)
    return {"rate": rate, "metrics": m.to_dict(), "scheduled_rate": run.scheduled_rate, **shipped,
            "max_send_lag_s": run.max_send_lag_s, "exact_lengths": _exact(run),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "prometheus": run.prometheus,
            "requests": [rec.compact(r) for r in run.records]}


def kv_shipped(prometheus: dict, completed: int) -> dict:
    """KV bytes the prefill nodes sent over the run, per completed request (pdserve disaggregated:
    pdserve_kv_bytes_sent_total, by the nodes' heartbeats), and where the router had prompts
    computed (pdserve_router_prefills_total); zeros for servers without these series."""
    deltas = prometheus.get("counter_deltas", {})
    total = lambda prefix: sum(v for k, v in deltas.items() if k.startswith(prefix))    # noqa: E731
    return {"kv_bytes_per_request": total("pdserve_kv_bytes_sent_total") / max(1, completed),
            "local_prefills": total('pdserve_router_prefills_total{where="local"'),
            "remote_prefills": total('pdserve_router_prefills_total{where="remote"')}


def _exact(run: RunResult) -> bool:
    """Every completed request streamed exactly the output length asked for."""
    return all(r.output_tokens == r.expected_output_len for r in run.records if r.success)


def _workload_summary(spec: SweepSpec, point: int, block_size: int = 16) -> dict:
    """Length statistics, and the KV bytes a 1P+1D deployment ships per request when nothing is
    cached on the decode side (whole blocks: the partial last block ships too)."""
    requests = generate(spec.workload_at(point))
    per_token = rec.kv_bytes_per_token(spec.knobs.dtype)
    shipped = [-(-r.prompt_len // block_size) * block_size * per_token for r in requests]
    return summary(requests) | {"kv_bytes_per_token": per_token, "kv_bytes_shipped_mean": sum(shipped) / len(shipped)}


def _warmup(spec: SweepSpec):
    return generate(WorkloadSpec("alpaca", 2, seed=10**6, max_model_len=spec.knobs.max_model_len))


def _save(result: dict, bench: str, path: str | None) -> str:
    if path and os.path.exists(path):
        os.remove(path)
    return rec.write(result, bench)
