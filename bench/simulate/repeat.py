"""One request measured three times: a measure file runs the same requests at the same times on
colocated, 1P+1D and 1P+2D, and a warm RAG question (its document cached, its few tokens prefilled
where it decodes) takes nearly the same path in each. The lowest of its three measured TTFTs is the
closest this machine came to running it undisturbed; the median of the three, how much a typical
run adds to that (a busy process, a late wake-up: delays only ever add). The simulator models an
undisturbed machine, so it is held against both.

    python -m bench.simulate repeat bench/validation/quiet3/simulate_measured_rag_*.json --profile P.json
"""
from __future__ import annotations

import json
import statistics

from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate

WARM = "rag"        # bench/serving/workloads.py: a question whose document an earlier request sent


def warm_questions(measured: dict, profile: Profile) -> list[dict]:
    """Per rate point: the warm questions, and per question its measured TTFTs (ms, one a system)
    and the simulated ones."""
    sweep, systems = measured["sweep"], measured["systems"]
    out = []
    for i, rate in enumerate(sweep["rates"]):
        simulated = {}
        for system, run in systems.items():
            reqs = point_requests(sweep, i, rate, profile, run["points"][i].get("requests"))
            simulate(profile, reqs, topology(system, run, measured.get("machine", {}).get("nproc", 0)),
                     SLOTargets(), ranked_before=ranked_before(run, i))
            simulated[system] = [r.ttft * 1e3 for r in reqs]
        first = next(iter(systems.values()))["points"][i]["requests"]
        questions = [{"measured": [run["points"][i]["requests"][j]["ttft_ms"] for run in systems.values()],
                      "simulated": [simulated[s][j] for s in systems]}
                     for j, r in enumerate(first) if r["kind"] == WARM]
        out.append({"workload": sweep["workload"], "rate": rate, "questions": questions})
    return out


def summary(point: dict) -> str:
    """The point's warm questions: simulated (median over systems) against the lowest measured, and
    the median measured against the lowest."""
    q = point["questions"]
    sim_low = [statistics.median(x["simulated"]) / min(x["measured"]) - 1 for x in q]
    mid_low = [statistics.median(x["measured"]) / min(x["measured"]) - 1 for x in q]
    return (f"{point['workload']} {point['rate']:g}: {len(q)} warm questions; simulated / lowest measured: median "
            f"{statistics.median(sim_low):+.0%}, within 20% at {sum(abs(x) <= 0.2 for x in sim_low)}; "
            f"median / lowest measured: median {statistics.median(mid_low):+.0%}")


def repeat(paths: list[str], profile_path: str) -> str:
    profile = Profile.load(profile_path)
    lines = []
    for path in paths:
        with open(path) as f:
            lines += [summary(p) for p in warm_questions(json.load(f), profile)]
    text = "\n".join(lines)
    print(text)
    return text
