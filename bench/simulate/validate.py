"""The simulated half of the validation: every measured point (measure.py) simulated with the same
requests, arrival times and topology, side by side with what was measured; a point agrees when
TTFT p50, TTFT p90 and TPOT p50 are each within 20% of the measured value.

The topology includes the pinning the run used (the measured file's `cores`, written from
pinning.py's PINS): on this 2-core machine 1P+2D's decode nodes share core 1, and so they do in the
simulation (pdplan/sim_core.py)."""
from __future__ import annotations

import argparse

import json
import math
import os
from dataclasses import replace

from bench.serving import record as rec
from bench.simulate import node_steps
from bench.simulate.contention import fit_background, measured_wait
from bench.simulate.pinning import PINS
from bench.simulate.probe_price import probe_k
from bench.simulate.sampling import inside, interval, values
from bench.simulate.sensitivity import spread, verdict
from bench.simulate.trace import OLD_CLIENT_WARMUP
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, Topology, simulate
from pdplan.workload import sim_requests

TOPOLOGY = {"colocated": Topology(colocated=1), "1p1d": Topology.disaggregated(1, 1),
            "1p2d": Topology.disaggregated(1, 2)}
TOLERANCE = 0.2
# Requests the router ranks before a run's first point: `pdserve up`'s own first request
# (router/launcher.py _first_request) and measure.py's warm-up (its file's warmup_requests; 2, as
# compare._warmup, before it recorded them): the router's coin (routing_cost.py) draws for each,
# and the simulated one draws as many (placement.py's records: 51 DecodeRequests in a run of
# 2 x 24 requests with 2 warm-up requests)
LAUNCHER_REQUESTS = 1
COLOCATED = "colocated-0"       # the colocated server's node name (PINS, the simulated pool)
FIGURES = (("TTFT p50", "ttft", "p50"), ("TTFT p90", "ttft", "p90"), ("TPOT p50", "tpot", "p50"))


def topology(system: str, measured: dict, machine_cores: int = 0) -> Topology:
    """The system as it ran: its pools, pinned as the run recorded (or as PINS says), on the
    measuring machine's cores (the router and the load generator float there)."""
    cores = measured.get("cores") or PINS[system]
    return TOPOLOGY[system].pinned({node: set(c) for node, c in cores.items()}, machine_cores)


def predict(measured: dict, profile: Profile, contention: bool = False, replay: bool = False, jitter: int = 0,
            speed: bool = False, probe_speed: bool = False, node_speed: str = "", sampling: bool = False) -> list[dict]:
    """One row per (system, rate): measured and simulated figures, in ms; with `contention` (and
    the point's schedstat), also simulated under the machine's load fitted per core (contention.py);
    with `replay`, each request decoded on the node the measured run's router chose (placement.py),
    where the file records it; with `jitter`, each figure's spread over that many runs with the
    requests sent a fraction of a ms late and the steps priced 1% higher or lower (sensitivity.py), the
    node-priced figures' too (`node_priced_spread`) where `node_speed` priced the point. A row of a run that recorded placement
    counts the requests whose simulated decode node is the measured one (`placement`: agreed,
    recorded); `cpu_per_price`: each pinned node's measured CPU time over the time its simulated
    steps were priced at (how fast its engine ran against the profile, its loop's work included);
    with `speed`, a colocated point is also simulated with every step priced at that ratio
    (`at_speed`: each figure's error; it reads the run it predicts, as `contention` does); with
    `probe_speed`, a point whose run and profile both probed the machine's speed is also simulated
    with every step priced k times (`probe_k`, probe_price.py: how much slower the machine was
    than when profiled; `probed`, `probed_error`), and probe_k is None for the others; with
    `node_speed` ("cpu" or "wall"), a point that recorded its nodes' steps (measure.py, node_steps.py)
    is also simulated with each node's steps priced at the median of its measured / priced ratios
    (`node_speed`: node -> (factor, steps, source), node_steps.point_speeds: a node with too few
    steps takes the point's median over all its nodes' steps; `node_priced`, `node_priced_error`);
    with `sampling`, each measured figure's 90% bootstrap interval over the point's requests
    (`interval`, sampling.py: it depends on the run alone, so calibrate's searches, which call this
    once per candidate price, leave it out)."""
    sweep = measured["sweep"]
    if sweep.get("max_concurrency") is not None:
        raise ValueError("the simulator replays open-loop arrivals; a sweep with max_concurrency cannot be validated")
    rows, base = [], profile
    for system, out in measured["systems"].items():
        profile = served_as(base, out.get("server", {}).get("argv", []))
        for i, point in enumerate(out["points"]):
            reqs = point_requests(sweep, i, point["rate"], profile, point.get("requests"))
            placed = [r.get("decode_node", "") for r in point.get("requests", [])]
            if replay and len(placed) == len(reqs):
                for r, node in zip(reqs, placed):
                    r.replay_decode = node
            slo = SLOTargets(sweep["slo"]["ttft_ms"], sweep["slo"]["tpot_ms"])
            topo, cores = topology(system, out, measured.get("machine", {}).get("nproc", 0)), out.get("cores") or PINS[system]
            before = ranked_before(out, i)
            sim = simulate(profile, reqs, topo, slo, ranked_before=before)
            waits, background, loaded = {}, {}, None
            if contention:
                waits = measured_wait(point, cores)
                background = fit_background(lambda b: simulate(profile, reqs, topo, slo, background=b, ranked_before=before), waits, cores)
                loaded = simulate(profile, reqs, topo, slo, background=background, ranked_before=before) if waits else sim
            m = point["metrics"]
            row = {"workload": sweep["workload"], "system": system, "rate": point["rate"],
                   "completed": f"{m['completed']}/{m['num_sent']}", "loadavg": point["loadavg_before"][0],
                   "sim_utilization": sim.utilization, "sim_preemptions": sim.preemptions,
                   "measured_wait_per_run": waits, "background": background,
                   "placement": placement_agreement(reqs, placed), "cpu_per_price": cpu_per_price(point, sim),
                   "cpu_beyond_per_idle": cpu_beyond_per_idle(point, sim),
                   "core_steal_s": point.get("core_steal_s", {})}
            spreads = spread(lambda rs, p: simulate(p, rs, topo, slo, ranked_before=before), reqs, profile, FIGURES,
                             jitter, i) if jitter else {}
            fast = simulate(replace(profile, step=profile.step.scaled(row["cpu_per_price"][COLOCATED])), reqs, topo, slo,
                            ranked_before=before) \
                if speed and COLOCATED in row["cpu_per_price"] else None
            if probe_speed:
                row["probe_k"] = probe_k(point, profile, cores)
            probed = simulate(replace(profile, step=profile.step.scaled(row["probe_k"])), reqs, topo, slo,
                              ranked_before=before) if row.get("probe_k") else None
            if node_speed and point.get("steps"):
                row["node_speed"] = {n: tuple(s) for n, s in
                                     node_steps.node_speeds(point["steps"], profile.step, node_speed).items()}
            node_map = {n: s[0] for n, s in row["node_speed"].items()} if row.get("node_speed") else None
            node_priced = simulate(profile, reqs, topo, slo, ranked_before=before, speed=node_map) if node_map else None
            node_spreads = spread(lambda rs, p: simulate(p, rs, topo, slo, ranked_before=before, speed=node_map), reqs,
                                  profile, FIGURES, jitter, i) if jitter and node_map else {}
            for label, metric, pct in FIGURES:
                real, pred = m[metric][pct], getattr(getattr(sim, f"{metric}_ms"), pct)
                row[label] = {"measured": real, "simulated": pred, "error": (pred - real) / real if real else None}
                if sampling and point.get("requests"):
                    row[label]["interval"] = interval(values(point["requests"], metric), pct)
                if fast is not None:
                    row[label]["at_speed"] = getattr(getattr(fast, f"{metric}_ms"), pct) / real - 1
                if spreads:
                    row[label]["spread"] = (min(spreads[label][0], pred), max(spreads[label][1], pred))
                for name, other in (("loaded", loaded), ("probed", probed), ("node_priced", node_priced)):
                    if other is not None:
                        pred = getattr(getattr(other, f"{metric}_ms"), pct)
                        row[label] |= {name: pred, f"{name}_error": (pred - real) / real if real else None}
                if node_spreads:
                    lo, hi = node_spreads[label]
                    row[label]["node_priced_spread"] = (min(lo, row[label]["node_priced"]), max(hi, row[label]["node_priced"]))
            rows.append(row)
    return rows


def served_as(profile: Profile, argv: list[str]) -> Profile:
    """The profile with the measured server's own scheduling flags, where its command line set
    them (`--long-prefill-token-threshold N`): the simulated nodes schedule as the measured ones."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--long-prefill-token-threshold", type=int)
    cap = ap.parse_known_args(argv)[0].long_prefill_token_threshold
    return profile if cap is None else replace(profile, long_prefill_token_threshold=cap)


def point_requests(sweep: dict, i: int, rate: float, profile: Profile, sent: list[dict] | None = None) -> list:
    """The requests of a measured sweep's point i, at `rate`, as measure.py sent them: the same
    prompts, lengths and arrival times, in the order its file records them. sent: the point's
    request records; each request then arrives when the load generator sent it (its send_ms, where
    the measured TTFT starts: loadgen.py), not when the schedule said: the generator's event loop
    can send late (a 200 ms stall at ShareGPT-like 1P+1D 1 req/s in quiet8 and quiet10, bench/README.md
    sim19), and a request the router gets late finds another queue."""
    reqs = sim_requests(sweep["workload"], sweep["num_requests"], rate, sweep["seed"] + i, profile.block_size,
                        sweep["knobs"]["max_model_len"], burstiness=sweep["burstiness"], output_cap=sweep["output_cap"])
    if sent and len(sent) == len(reqs):
        for r, record in zip(reqs, sent):
            if record.get("send_ms", -1) >= 0:      # -1 s: never sent (the deadline)
                r.arrival = record["send_ms"] / 1e3
    return reqs


def ranked_before(out: dict, point: int) -> int:
    """Requests the router of a measured run (one system's part of a measure file) had ranked
    before point `point`: the launcher's, the warm-up's and the earlier points'."""
    return LAUNCHER_REQUESTS + out.get("warmup_requests", OLD_CLIENT_WARMUP) \
        + sum(len(q.get("requests", ())) for q in out["points"][:point])


def cpu_per_price(point: dict, sim) -> dict[str, float]:
    """Pinned node -> its measured CPU time (schedstat, the point's `cpu`) over its simulated busy time."""
    return {node: round(c["run_s"] / sim.node_times[node][0], 2) for node, c in point.get("cpu", {}).items()
            if sim.node_times.get(node, (0.0,))[0] > 0}


def cpu_beyond_per_idle(point: dict, sim) -> dict[str, float]:
    """Pinned node -> its measured CPU beyond its simulated busy time, per second the simulation had
    it without a step (the point's wall less its steps' wall), where that is at least a quarter of
    the point: what its loop spends between steps. A prefill node's is 3-6% on this host at most
    points (its loop wakes every 5 ms when idle: node_shell/runtime.py IDLE_POLL_S), so its
    cpu_per_price above 1 need not be slower steps (bench/README.md, sim19)."""
    wall, out = point.get("cpu_wall_s", 0.0), {}
    for node, c in point.get("cpu", {}).items():
        busy, stepping = sim.node_times.get(node, (0.0, 0.0))
        if busy > 0 and wall - stepping >= wall / 4:
            out[node] = round((c["run_s"] - busy) / (wall - stepping), 3)
    return out


def placement_agreement(reqs: list, placed: list[str]) -> tuple[int, int] | None:
    """(requests simulated on the decode node the router chose, requests it recorded), node by node
    name: the simulated pool names its nodes as `pdserve up` does and draws the router's coin in
    the router's order (decode_pool.py), so decode-0 is the same node in both; None when the run
    recorded none (colocated, or an older file)."""
    known = [(r.decode_node, node) for r, node in zip(reqs, placed) if node]
    if not known or len(placed) != len(reqs):
        return None
    return sum(1 for sim, node in known if sim == node), len(known)


def markdown(rows: list[dict]) -> str:
    """Measured / simulated (error); with contention fitted, a third figure: simulated under it; with
    the probe's pricing, after the verdict: its k, each figure's error and its own verdict."""
    loaded = any("loaded" in r[FIGURES[0][0]] for r in rows)
    probing = any("probe_k" in r for r in rows)
    node_priced = any("node_speed" in r for r in rows)
    sims = "sim / sim loaded" if loaded else "sim"
    head = "| workload | system | rate | load avg | " + " | ".join(f"{f} measured / {sims} (err)" for f, _, _ in FIGURES) \
        + (" | within 20% (sim / loaded) |" if loaded else " | within 20% |") + (PROBE_HEAD if probing else "") \
        + (NODE_HEAD if node_priced else "")
    lines = [head, "|" + "---|" * (5 + len(FIGURES) + 3 * probing + 3 * node_priced)]
    for r in rows:
        cells = [" / ".join([_ms(r[f]["measured"])] + [f"{_ms(r[f][k])} ({r[f][k + '_error'] if k != 'simulated' else r[f]['error']:+.0%})"
                                                       for k in ("simulated", "loaded") if k in r[f]]) + _spread(r[f])
                 for f, _, _ in FIGURES]
        ok = [verdict(r, FIGURES, TOLERANCE) if "spread" in r[FIGURES[0][0]] else _ok(r, "error")] \
            + ([_ok(r, "loaded_error")] if "loaded" in r[FIGURES[0][0]] else [])
        lines.append(f"| {r['workload']} | {r['system']} | {r['rate']:g} | {r['loadavg']:.1f} | " + " | ".join(cells)
                     + f" | {' / '.join(ok)} |" + (_probed(r) if probing else "") + (_node_priced(r) if node_priced else ""))
    return "\n".join(lines)


PROBE_HEAD = " probe k | probe-priced err (" + " / ".join(f for f, _, _ in FIGURES) + ") | within 20% probe-priced |"


def _probed(row: dict) -> str:
    """' 1.32 | -5% / +3% / -8% | yes |': the probe's k, the errors at it and their verdict; dashes
    where the point or the profile recorded no probe."""
    if not row.get("probe_k"):
        return " - | - | - |"
    errors = " / ".join(f"{row[f]['probed_error']:+.0%}" for f, _, _ in FIGURES)
    return f" {row['probe_k']:.2f} | {errors} | {_ok(row, 'probed_error')} |"


FALLBACK = {"node": "", "point": ": the point's", "none": ": too few, 1.0"}
NODE_HEAD = " node speed (steps) | node-priced err (" + " / ".join(f for f, _, _ in FIGURES) + ") | within 20% node-priced |"


def _node_priced(row: dict) -> str:
    """' decode-0 1.12 (2210), prefill-0 1.12 (12: the point's) | -5% / +3% / -8% | yes |': each node's
    factor and its steps (too few: the point's median, or 1.0), the errors at them and their verdict;
    dashes where the point recorded no steps."""
    if not row.get("node_speed"):
        return " - | - | - |"
    nodes = ", ".join(f"{n} {_factor(k)} ({steps}{FALLBACK[source]})" for n, (k, steps, source) in row["node_speed"].items())
    jittered = "node_priced_spread" in row[FIGURES[0][0]]
    errors = " / ".join(f"{row[f]['node_priced_error']:+.0%}" + (_spread(row[f], "node_priced_spread") if jittered else "")
                        for f, _, _ in FIGURES)
    ok = verdict(row, FIGURES, TOLERANCE, "node_priced") if jittered else _ok(row, "node_priced_error")
    return f" {nodes} | {errors} | {ok} |"


def _factor(k) -> str:
    """'1.12', or a KindSpeed's '1.12/0.88/1.07' (decode rows / short chunks' rows / long chunks' rows)."""
    return f"{k:.2f}" if isinstance(k, float) else str(k)


def _spread(figure: dict, key: str = "spread") -> str:
    """' [-31%..-27%]': the error's range over the jittered runs (figure[key]), when there were any."""
    if key not in figure:
        return ""
    lo, hi = ((v - figure["measured"]) / figure["measured"] for v in figure[key])
    return f" [{lo:+.0%}..{hi:+.0%}]"


def _sampling(rows: list[dict]) -> str:
    """The figures beyond 20%, each with its measured value's 90% bootstrap interval (sampling.py)
    and whether the simulated one lies inside it (the node-priced one where the point has it, the
    unjittered figure even where the table's verdict reads a jittered spread; a point without a
    successful request to resample shows "no sample"); '' when no row resampled its requests."""
    if not any("interval" in r[FIGURES[0][0]] for r in rows):
        return ""
    key = lambda r: "node_priced" if "node_priced" in r[FIGURES[0][0]] else "simulated"   # noqa: E731
    misses = [(r, f, r[f][key(r)]) for r in rows for f, _, _ in FIGURES if "interval" in r[f] and r[f]["measured"]
              and abs(r[f][key(r)] / r[f]["measured"] - 1) > TOLERANCE]
    held = sum(inside(sim, r[f]["interval"]) for r, f, sim in misses)
    return (f"\n\nfigures beyond 20% (node-priced where priced), each with its measured figure's 90% interval over "
            f"the point's requests resampled (bootstrap): {held} of {len(misses)} simulated inside it") + "".join(
        f"; {r['workload']} {r['system']} {r['rate']:g} {f}: measured {_ms(r[f]['measured'])} "
        + (f"[{_ms(r[f]['interval'][0])}..{_ms(r[f]['interval'][1])}]" if not math.isnan(r[f]["interval"][0])
           else "[no sample]") + f", simulated {_ms(sim)} "
        + ("inside" if inside(sim, r[f]["interval"]) else "outside") for r, f, sim in misses)


def _ms(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _ok(row: dict, key: str) -> str:
    return "yes" if all(abs(row[f][key]) <= TOLERANCE for f, _, _ in FIGURES) else "no"


def validate(paths: list[str], profile_path: str, contention: bool = False, replay: bool = False,
             jitter: int = 0, speed: bool = False, probe_speed: bool = False, node_speed: str = "") -> str:
    profile = Profile.load(profile_path)
    rows = []
    for path in paths:
        with open(path) as f:
            rows += predict(json.load(f), profile, contention, replay, jitter, speed, probe_speed, node_speed,
                            sampling=True)
    table = markdown(rows)
    if node_speed and not any(r.get("node_speed") for r in rows):
        table += "\n\nno point recorded its nodes' steps (measured before node_steps.py): nothing node-priced"
    if probe_speed and "speed" not in profile.machine:
        table += f"\n\n{profile_path} recorded no speed probe (made before pdplan/speed_probe.py): nothing probe-priced"
    table += "\n\nmeasured CPU / simulated busy: " + "; ".join(
        f"{r['workload']} {r['system']} {r['rate']:g}: " + " ".join(f"{n} {v:.2f}" for n, v in r["cpu_per_price"].items())
        for r in rows if r["cpu_per_price"])
    idle = [r for r in rows if r["cpu_beyond_per_idle"]]
    if idle:
        table += "\n\nmeasured CPU beyond simulated busy, per second of simulated idle: " + "; ".join(
            f"{r['workload']} {r['system']} {r['rate']:g}: " + " ".join(f"{n} {v:.1%}" for n, v in r["cpu_beyond_per_idle"].items())
            for r in idle)
    stolen = [r for r in rows if r["core_steal_s"]]
    if stolen:
        table += "\n\nseconds the host took from each core during the point (steal): " + "; ".join(
            f"{r['workload']} {r['system']} {r['rate']:g}: " + " ".join(f"{c} {v:.1f}" for c, v in r["core_steal_s"].items())
            for r in stolen)
    fast = [r for r in rows if "at_speed" in r[FIGURES[0][0]]]
    if fast:
        table += "\n\ncolocated, every step priced at the run's CPU / simulated busy (errors): " + "; ".join(
            f"{r['workload']} {r['rate']:g}: " + " ".join(f"{r[f]['at_speed']:+.0%}" for f, _, _ in FIGURES) for r in fast)
    table += _sampling(rows)
    agreed = [f"{r['workload']} {r['system']} {r['rate']:g}: {r['placement'][0]}/{r['placement'][1]}"
              for r in rows if r["placement"]]
    if agreed:
        table += "\n\nrequests decoded where the router put them" + (" (replayed)" if replay else "") \
            + ": " + "; ".join(agreed)
    out = rec.write({"bench": "simulate_validation", "profile": profile_path, "measured": paths, "rows": rows,
                     "replay_placement": replay, "jitter_runs": jitter, "at_speed": speed, "probe_speed": probe_speed,
                     "node_speed": node_speed},
                    "simulate_validation")
    print(table + f"\n\nwrote {out}")
    return os.path.abspath(out)
