"""Fits a profile's serving-path overheads (pdplan/profile.py: Overheads) to real runs, so that
the engine-only profile also prices HTTP, tokenizing, control messages and streaming:

  1. request_s: the median, over every colocated request of the calibration runs that completed,
     of its measured TTFT less its simulated one (request_s 0): a constant added to every arrival
     shifts a colocated run whole, so that median is the fit's own (colocated_gaps). Before, the
     median of the points' two TTFT p50 gaps: two numbers, which on quiet4 were 47.1 and 8.8 ms
  2. handoff_s: the prefill hop's cost (from 0 to 100 ms in 5 ms steps) that best matches the
     disaggregated points' TTFT p50s, request_s included (a local prefill skips the hop, so the
     gap is not one constant per request)
  3. token_s: the per-token cost (from a short list) that best matches the TPOT p50s
  0. first, not fitted but measured: router_token_s and client_token_s, the CPU seconds per output
     token of the processes pinned nowhere (a disaggregated router, the load generator), and
     router_per_s and client_per_s, their CPU seconds per second of the run whatever streams
     (heartbeats, polls), from the points' float_cpu and wall time (measure.py; least squares over
     the points), or from `float_from` files when the runs predate it; and
     prompt_token_s, the front end's cost per prompt token, from traces (trace.py front_end), so
     that request_s is what is left of it, and of it front_cpu_token_s, the tokenizing calls' CPU
     (trace.py front_cpu: what a pinned colocated server's front end takes from its engine's
     core, pdplan/colocated.py), and admit_token_s, a disaggregated router's per prompt
     token from its backend to the decode node's reservation (trace.py admission); and what a
     colocated server's loop costs its engine beyond a decode node's (loop_cost.py colocated_extra,
     from traces of both), which the colocated TTFT p50 gap of step 1 then no longer holds

Calibrate on one workload and validate on the others (held out): validate.py reports both.

With `node_speed` ("cpu", "wall" or "kind": validate.py's flag of that name), every simulation of the fit
prices each node at its recorded steps' speed (node_steps.py), as validate --node-speed then
predicts: fitted on raw prices, request_s and token_s absorb the nodes' slowness (a serving node's
decode step took 1.03-1.29x its price in quiet12), which the node-priced validation then counts again.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import replace

import numpy as np

from bench.simulate import node_steps
from bench.simulate.validate import point_requests, predict, topology
from pdplan.profile import Overheads, Profile
from pdplan.simulation import SLOTargets, simulate

TOKEN_S = (0.0, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)
HANDOFF_S = tuple(i * 5e-3 for i in range(21))


def calibrate(paths: list[str], profile: Profile, float_from: list[str] = (),
              traced: Overheads = Overheads(), node_speed: str = "") -> Profile:
    """traced: the overheads measured from traces (prompt_token_s, admit_token_s, colocated_*), kept
    as they are; the rest are measured (router_token_s, client_token_s) or fitted here; node_speed:
    the fit's simulations price each node at its steps' speed on that basis (the module docstring)."""
    measured = [json.load(open(p)) for p in paths]
    router_s, client_s, router_per_s, client_per_s = floating_cpu(
        [json.load(open(p)) for p in float_from] or measured)
    p = replace(profile, overheads=replace(traced, router_token_s=router_s, client_token_s=client_s, request_s=0.0,
                                           router_per_s=router_per_s, client_per_s=client_per_s,
                                           handoff_s=0.0, token_s=0.0))
    p = replace(p, overheads=replace(p.overheads, token_s=_best_token_s(measured, p, node_speed)))
    gaps = colocated_gaps(measured, p, node_speed)
    request_s = max(0.0, statistics.median(gaps)) if gaps else 0.0
    if gaps:
        q = statistics.quantiles(gaps, n=4) if len(gaps) > 1 else gaps * 3
        print(f"request_s {request_s * 1e3:.1f} ms: the median of {len(gaps)} colocated requests' TTFT gaps "
              f"(measured - simulated; quartiles {q[0] * 1e3:.1f} .. {q[2] * 1e3:.1f} ms)")
    p = replace(p, overheads=replace(p.overheads, request_s=request_s))
    return replace(p, overheads=replace(p.overheads, handoff_s=_best_handoff_s(measured, p, node_speed)))


def colocated_gaps(measured: list[dict], profile: Profile, node_speed: str = "") -> list[float]:
    """Seconds, one per colocated request of the measured files that completed: its measured TTFT
    less its TTFT simulated with `profile` (the point's requests, arrivals and pinning, as
    validate.py simulates them; with node_speed, the node priced at its steps' speed where the
    point recorded them)."""
    gaps = []
    for m in measured:
        out = m["systems"].get("colocated")
        if out is None:
            continue
        for i, point in enumerate(out["points"]):
            reqs = point_requests(m["sweep"], i, point["rate"], profile, point.get("requests"))
            speed = node_steps.speed_map(point.get("steps"), profile.step, node_speed)
            simulate(profile, reqs, topology("colocated", out, m.get("machine", {}).get("nproc", 0)), SLOTargets(),
                     speed=speed)
            gaps += [q["ttft_ms"] / 1e3 - r.ttft for r, q in zip(reqs, point["requests"])
                     if q["success"] and r.done]
    return gaps


def floating_cpu(measured: list[dict]) -> tuple[float, float, float, float]:
    """(router, client) CPU seconds per output token, then (router, client) per second of the run:
    least squares over the points that recorded them (a disaggregated router's only: a colocated
    one is its engine's process) of each process's CPU on the point's tokens and wall time; where
    fewer than two points have a wall time or a coefficient comes out negative, the per-token
    figure alone, the median over the points, and none per second; 0 without any."""
    router, client = [], []
    for m in measured:
        systems = m["systems"] if "systems" in m else {m["system"]: m}     # a measure file, or a trace's
        for system, out in systems.items():
            for point in out["points"]:
                cpu, tokens = point.get("float_cpu"), point["metrics"]["total_output_tokens"]
                if not cpu or not tokens:
                    continue
                wall = point.get("cpu_wall_s", 0.0)
                client.append((cpu["client"]["run_s"], tokens, wall))
                if "router" in cpu:
                    router.append((cpu["router"]["run_s"], tokens, wall))
    (rt, rs), (ct, cs) = _per_token_and_second(router), _per_token_and_second(client)
    return rt, ct, rs, cs


def _per_token_and_second(points: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(per token, per second) for [(CPU seconds, tokens, wall seconds), ...] (floating_cpu)."""
    if not points:
        return 0.0, 0.0
    timed = [p for p in points if p[2] > 0]
    if len(timed) >= 2:
        (per_token, per_s), *_ = np.linalg.lstsq(np.array([[t, w] for _, t, w in timed], dtype=float),
                                                 np.array([c for c, _, _ in timed]), rcond=None)
        if per_token >= 0 and per_s >= 0:
            return float(per_token), float(per_s)
    return statistics.median(c / t for c, t, _ in points), 0.0


def _errors(measured: list[dict], profile: Profile, figure: str, node_speed: str) -> list[tuple[str, float]]:
    """(system, error of `figure`) per point: node-priced where the point recorded its steps and
    node_speed is set, else raw."""
    rows = [row for m in measured for row in predict(m, profile, node_speed=node_speed)]
    return [(r["system"], r[figure].get("node_priced_error", r[figure]["error"])) for r in rows]


def _best_token_s(measured: list[dict], profile: Profile, node_speed: str = "") -> float:
    def error(token_s: float) -> float:
        p = replace(profile, overheads=replace(profile.overheads, token_s=token_s))
        return sum(abs(e) for _, e in _errors(measured, p, "TPOT p50", node_speed))
    return min(TOKEN_S, key=error)


def _best_handoff_s(measured: list[dict], profile: Profile, node_speed: str = "") -> float:
    def error(handoff_s: float) -> float:
        p = replace(profile, overheads=replace(profile.overheads, handoff_s=handoff_s))
        return sum(abs(e) for system, e in _errors(measured, p, "TTFT p50", node_speed) if system != "colocated")
    return min(HANDOFF_S, key=error)
