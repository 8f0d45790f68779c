"""The simulated half of the validation: every measured point (measure.py) simulated with the same
requests, arrival times and topology, side by side with what was measured; a point agrees when
TTFT p50, TTFT p90 and TPOT p50 are each within 20% of the measured value.

The topology includes the pinning the run used (the measured file's `cores`, written from
pinning.py's PINS): on this 2-core machine 1P+2D's decode nodes share core 1, and so they do in the
simulation (pdplan/sim_core.py)."""
from __future__ import annotations

import json
import os

from bench.serving import record as rec
from bench.simulate.pinning import PINS
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, Topology, simulate
from pdplan.workload import sim_requests

TOPOLOGY = {"colocated": Topology(colocated=1), "1p1d": Topology.disaggregated(1, 1),
            "1p2d": Topology.disaggregated(1, 2)}
TOLERANCE = 0.2
FIGURES = (("TTFT p50", "ttft", "p50"), ("TTFT p90", "ttft", "p90"), ("TPOT p50", "tpot", "p50"))


def topology(system: str, measured: dict) -> Topology:
    """The system as it ran: its pools, pinned as the run recorded (or as PINS says)."""
    cores = measured.get("cores") or PINS[system]
    return TOPOLOGY[system].pinned({node: set(c) for node, c in cores.items()})


def predict(measured: dict, profile: Profile) -> list[dict]:
    """One row per (system, rate): measured and simulated figures, in ms."""
    sweep = measured["sweep"]
    rows = []
    for system, out in measured["systems"].items():
        for i, point in enumerate(out["points"]):
            reqs = sim_requests(sweep["workload"], sweep["num_requests"], point["rate"], sweep["seed"] + i,
                                profile.block_size, sweep["knobs"]["max_model_len"],
                                output_cap=sweep["output_cap"])
            slo = SLOTargets(sweep["slo"]["ttft_ms"], sweep["slo"]["tpot_ms"])
            sim = simulate(profile, reqs, topology(system, out), slo)
            m = point["metrics"]
            row = {"workload": sweep["workload"], "system": system, "rate": point["rate"],
                   "completed": f"{m['completed']}/{m['num_sent']}", "loadavg": point["loadavg_before"][0],
                   "sim_utilization": sim.utilization, "sim_preemptions": sim.preemptions}
            for label, metric, pct in FIGURES:
                real, pred = m[metric][pct], getattr(getattr(sim, f"{metric}_ms"), pct)
                row[label] = {"measured": real, "simulated": pred, "error": (pred - real) / real if real else None}
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| workload | system | rate | " + " | ".join(f"{f} measured / sim (err)" for f, _, _ in FIGURES) \
        + " | within 20% |"
    lines = [head, "|" + "---|" * (4 + len(FIGURES))]
    for r in rows:
        cells = []
        for label, _, _ in FIGURES:
            v = r[label]
            cells.append(f"{v['measured']:.0f} / {v['simulated']:.0f} ({v['error']:+.0%})" if v["measured"] >= 100
                         else f"{v['measured']:.1f} / {v['simulated']:.1f} ({v['error']:+.0%})")
        ok = all(abs(r[f]["error"]) <= TOLERANCE for f, _, _ in FIGURES)
        lines.append(f"| {r['workload']} | {r['system']} | {r['rate']:g} | " + " | ".join(cells)
                     + f" | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def validate(paths: list[str], profile_path: str) -> str:
    profile = Profile.load(profile_path)
    rows = []
    for path in paths:
        with open(path) as f:
            rows += predict(json.load(f), profile)
    table = markdown(rows)
    out = rec.write({"bench": "simulate_validation", "profile": profile_path, "measured": paths, "rows": rows},
                    "simulate_validation")
    print(table + f"\n\nwrote {out}")
    return os.path.abspath(out)
