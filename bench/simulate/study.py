"""On paper, past this machine: for each profile and workload, at 10 to 1,000 requests/s, the fewest
colocated replicas and the planner's P:D split that meet the SLOs, and the goodput per node of
each (requests/s meeting both SLOs for >= 90% of requests, divided by the nodes). JSON to
bench/results, one plot per profile to bench/plots.

Each plan is for the fleet's steady state: the first warmup_s seconds of arrivals (default
WARMUP_S) are simulated but not scored, so RAG's cold documents (seconds of prefill each on a CPU
node) weigh as they do in a fleet that has been serving for a while, not as a cold start.

SLOs are set per profile, a few times what a lone request takes on that hardware (a 1-core CPU
node prefills a 3k-token document in seconds, a GPU in ~0.2 s): see SLOS.
"""
from __future__ import annotations

import os
import time

from bench.serving import record as rec
from pdplan.planner import Planner, PlanRequest
from pdplan.profile import Profile

SLOS = {"cpu": (10000.0, 250.0), "gpu": (1000.0, 50.0)}    # TTFT, TPOT ms
WINDOW_S, WARMUP_S, MAX_REQUESTS = 20.0, 10.0, 1500


def kind(profile: Profile) -> str:
    return "gpu" if "gpu" in profile.machine else "cpu"


def study(profile_paths: list[str], rates: list[float], workloads: list[str], max_requests: int = MAX_REQUESTS,
          slo: tuple[float, float] | None = None, tag: str = "", warmup_s: float = WARMUP_S) -> str:
    path_json = None
    result = {"bench": "simulate_study", "window_s": WINDOW_S, "warmup_s": warmup_s, "max_requests": max_requests, "tag": tag,
              "profiles": {}}
    for path in profile_paths:
        profile = Profile.load(path)
        ttft, tpot = slo or SLOS[kind(profile)]
        rows: list[dict] = []
        result["profiles"][path] = {"source": profile.source, "extrapolated": profile.extrapolated,
                                    "machine": profile.machine, "model": profile.model, "slo_ms": [ttft, tpot],
                                    "plans": rows}
        for rate in rates:                  # rates outside: a run cut short still covers every workload
            for workload in workloads:
                t0 = time.perf_counter()
                planner = Planner(profile)
                plan = planner.plan(PlanRequest(workload, rate, ttft, tpot, window_s=WINDOW_S, warmup_s=warmup_s,
                                                max_requests=max_requests,
                                                min_requests=min(600, max_requests)))
                rows.append(plan.to_dict() | {"seconds": round(time.perf_counter() - t0, 1)})
                print(plan.describe() + f"\n  ({planner.simulations} simulations, {rows[-1]['seconds']} s)", flush=True)
                path_json = _save(result, tag, path_json)
    from bench.simulate.plots import plot_study
    for png in plot_study(result):
        print(f"plot {png}")
    print(f"wrote {path_json}")
    return path_json


def _save(result: dict, tag: str, previous: str | None) -> str:
    """After every plan, replacing the previous file: a run cut short keeps what it planned."""
    if previous and os.path.exists(previous):
        os.remove(previous)
    return rec.write(result, "_".join(filter(None, ("simulate_study", tag))))


def table(result: dict) -> str:
    """Markdown: per profile, workload and rate, both options' fleets and goodput per node."""
    lines = ["| profile | workload | rate | colocated | goodput/node | P:D split | goodput/node | P:D / colocated |",
             "|---|---|---|---|---|---|---|---|"]
    for path, prof in result["profiles"].items():
        name = os.path.basename(path).removesuffix(".json") + (" (extrapolated)" if prof["extrapolated"] else "")
        for plan in prof["plans"]:
            c, d = plan["colocated"], plan["disaggregated"]
            ratio = f"{d['goodput_per_node'] / c['goodput_per_node']:.2f}" if c["summary"] and d["summary"] else "-"
            lines.append(f"| {name} | {plan['request']['workload']} | {plan['request']['rate']:g} | "
                         f"{_fleet(c)} | {_fleet(d)} | {ratio} |")
    return "\n".join(lines)


def _fleet(option: dict) -> str:
    """'<fleet> | <goodput per node>', or none found (the search's node limit per slice)."""
    if option["summary"] is None:
        return "none found | -"
    return f"{option['topology'].replace(' colocated', '')} | {option['goodput_per_node']:.3f}"
