"""The planner: for SLOs (TTFT, TPOT, optionally ITL p90: slo.py), a workload and a rate, the fewest
nodes that meet the SLOs colocated, and
the P:D split that does (DistServe's question: goodput per node), both found with the simulator.

Search (A(P, D) = SLO attainment, non-decreasing in each pool's size):
  1. colocated: the fewest replicas N with A >= target (doubling, then bisection)
  2. disaggregated: with the other pool at N (ample; 2N if N is not: a decode pool can need more
     nodes than colocated replicas do), the fewest prefill nodes P0 and the fewest
     decode nodes D0 that reach the target; each alone is a lower bound, so the answer is the
     first (P0 + i, D0 + j), by total nodes i + j = 0, 1, 2 ..., that meets it (the best
     attainment among equals); then each pool is shrunk to the fewest nodes that still meet it
     with the other fixed (attainment is only nearly monotone: with RAG, 1P+9D met a target that
     2P+9D and 3P+9D missed, as prefix caches and local prefills shift with the pools)
  3. goodput per node = rate / nodes; the recommendation is the higher

Requests arriving in the first warmup_s seconds are simulated but not scored, so that a plan is for
the fleet's steady state (RAG's documents cached on every node) rather than its cold start.
Large rates are planned on a slice: arrivals must span a few request lifetimes (window_s), and
past max_requests the simulated fleet serves rate / k for the smallest such k; the plan is the
slice's times k (as DistServe replicates its best placement unit).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

from engine.flags import to_argv
from pdplan.autoscale_config import AutoscaleConfig
from pdplan.profile import Profile
from pdplan.sim_metrics import SimSummary
from pdplan.simulation import SLOTargets, Topology, simulate


@dataclass(frozen=True, slots=True)
class PlanRequest:
    workload: str
    rate: float                     # offered requests/s
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    slo_itl_ms: float | None = None  # p90 of each request's gaps between tokens; None: not a target
    attainment: float = 0.9         # share of requests that must meet every SLO
    min_requests: int = 600
    max_model_len: int = 4096
    max_nodes: int = 4096           # in the whole fleet
    max_slice_nodes: int = 512      # in the simulated slice (a search past it is too slow to be useful)
    window_s: float = 30.0          # scored arrivals span at least this (request lifetimes), up to max_requests
    warmup_s: float = 0.0           # arrivals before the window, run but not scored: a fleet's steady state
    #                                 (prefix caches warm, queues formed), not its cold start
    max_requests: int = 3000
    seed: int = 0

    @property
    def slo(self) -> SLOTargets:
        return SLOTargets(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_itl_ms)


@dataclass(frozen=True, slots=True)
class Option:
    topology: Topology              # the whole fleet (the slice times `scale`)
    summary: SimSummary | None      # of the simulated slice; None when no size met the target
    goodput_per_node: float

    def to_dict(self) -> dict:
        return {"topology": str(self.topology), "nodes": self.topology.nodes, "goodput_per_node": self.goodput_per_node,
                "summary": self.summary.to_dict() if self.summary else None}


@dataclass(frozen=True, slots=True)
class Plan:
    request: PlanRequest
    scale: int                      # the fleet is this many copies of the simulated slice
    colocated: Option
    disaggregated: Option
    simulations: int

    @property
    def best(self) -> Option | None:
        """The option with the most goodput per node (the fewer nodes on a tie), or None when
        neither met the SLOs with max_nodes nodes."""
        met = [o for o in (self.colocated, self.disaggregated) if o.summary is not None]
        return max(met, key=lambda o: (o.goodput_per_node, -o.topology.nodes)) if met else None

    def to_dict(self) -> dict:
        best = self.best
        return {"request": asdict(self.request), "scale": self.scale, "colocated": self.colocated.to_dict(),
                "disaggregated": self.disaggregated.to_dict(),
                "recommended": str(best.topology) if best is not None else None,
                "simulations": self.simulations,
                "autoscale": asdict(self.autoscale_config()) if self.disaggregated.summary else None}

    def describe(self) -> str:
        r = self.request
        lines = [f"plan for {r.workload} at {r.rate:g} req/s, SLOs {r.slo.describe()} for {r.attainment:.0%} of requests"
                 + (f" (simulated a 1/{self.scale} slice)" if self.scale > 1 else "")]
        for name, o in (("colocated", self.colocated), ("disaggregated", self.disaggregated)):
            if o.summary is None:
                lines.append(f"  {name:14s} no fleet of at most {r.max_nodes} nodes meets the SLOs")
                continue
            s = o.summary
            util = ", ".join(f"{k} {v:.0%}" for k, v in s.utilization.items())
            lines.append(f"  {name:14s} {str(o.topology):16s} goodput/node {o.goodput_per_node:7.3f} req/s  "
                         f"TTFT p50/p90 {s.ttft_ms.p50:.0f}/{s.ttft_ms.p90:.0f} ms  TPOT p50/p90 "
                         f"{s.tpot_ms.p50:.1f}/{s.tpot_ms.p90:.1f} ms  ITL p90 {s.itl_ms.p90:.1f} ms  attainment {s.slo_attainment:.1%}  busy {util}")
        best = self.best
        lines.append(f"  recommended: {best.topology}" if best is not None else
                     f"  recommended: none: at this rate no fleet of at most {r.max_nodes} nodes meets these SLOs "
                     f"for {r.attainment:.0%} of requests (relax a target or the attainment)")
        if self.disaggregated.summary is not None:
            lines.append("  autoscale the split with: pdserve up " + " ".join(to_argv(self.autoscale_config())))
        return "\n".join(lines)

    def autoscale_config(self) -> AutoscaleConfig:
        """The live autoscaler's flags for the planned split: the same TTFT target, the ITL target
        (the ITL SLO; without one the TPOT SLO, the mean gap the plan met), and the planned
        pools as each pool's ceiling."""
        r, t = self.request, self.disaggregated.topology
        return AutoscaleConfig(autoscale=True, autoscale_max_prefill=max(1, t.prefill), autoscale_max_decode=max(1, t.decode),
                               autoscale_slo_ttft_ms=r.slo_ttft_ms,
                               autoscale_slo_itl_ms=r.slo_itl_ms if r.slo_itl_ms is not None else r.slo_tpot_ms)


class Planner:
    def __init__(self, profile: Profile, requests_for: Callable | None = None):
        """requests_for(workload, n, rate, seed, block_size, max_model_len) -> [SimRequest]
        (default: the serving benchmark's workloads, pdplan/workload.py)."""
        if requests_for is None:
            from pdplan.workload import sim_requests as requests_for
        self.profile, self.requests_for = profile, requests_for
        self.simulations = 0

    def plan(self, req: PlanRequest) -> Plan:
        n = max(req.min_requests, math.ceil(req.rate * (req.window_s + req.warmup_s)))
        scale = math.ceil(n / req.max_requests)
        rate = req.rate / scale
        requests = self.requests_for(req.workload, min(n, req.max_requests), rate, req.seed,
                                     self.profile.block_size, req.max_model_len)
        slo = req.slo
        seen: dict[Topology, SimSummary] = {}
        run = lambda topo: seen.get(topo) or seen.setdefault(topo, self._run(requests, topo, slo, req.warmup_s))  # noqa: E731
        limit = max(1, min(req.max_nodes // scale, req.max_slice_nodes))
        colocated = self._colocated(run, req.attainment, limit)
        disagg = self._disaggregated(run, req.attainment, limit, colocated.topology.colocated or limit)
        return Plan(req, scale, self._option(colocated, scale, req.rate), self._option(disagg, scale, req.rate),
                    self.simulations)

    def _run(self, requests, topo: Topology, slo: SLOTargets, warmup_s: float) -> SimSummary:
        self.simulations += 1
        return simulate(self.profile, requests, topo, slo, warmup_s=warmup_s)

    def _colocated(self, run, target: float, limit: int) -> "_Found":
        n = fewest(lambda k: run(Topology(colocated=k)).slo_attainment >= target, limit)
        return _Found(Topology(colocated=n), run(Topology(colocated=n))) if n else _Found(Topology(colocated=limit), None)

    def _disaggregated(self, run, target: float, limit: int, colocated: int) -> "_Found":
        for ample in dict.fromkeys((colocated, min(limit, 2 * colocated))):
            found = self._split(run, target, limit, ample)
            if found.summary is not None:
                return found
        return found

    def _split(self, run, target: float, limit: int, ample: int) -> "_Found":
        ok = lambda p, d: run(Topology.disaggregated(p, d)).slo_attainment >= target   # noqa: E731
        p0 = fewest(lambda p: ok(p, ample), limit)
        d0 = fewest(lambda d: ok(ample, d), limit)
        if not p0 or not d0:
            return _Found(Topology.disaggregated(limit, limit), None)
        for extra in range(0, 2 * ample + 1):
            found = [(s, t) for i in range(extra + 1)
                     if (t := Topology.disaggregated(p0 + i, d0 + extra - i)).nodes <= limit
                     and (s := run(t)).slo_attainment >= target]
            if found:
                s, t = max(found, key=lambda st: st[0].slo_attainment)
                return self._shrink(run, target, t, s)
        return _Found(Topology.disaggregated(limit, limit), None)

    @staticmethod
    def _shrink(run, target: float, t: Topology, s: SimSummary) -> "_Found":
        """The fewest prefill nodes that meet the target with t's decode pool (from 1 up: prefill
        pools are small), then decode nodes taken away one at a time while it still holds."""
        for p in range(1, t.prefill):
            if (sp := run(Topology.disaggregated(p, t.decode))).slo_attainment >= target:
                t, s = Topology.disaggregated(p, t.decode), sp
                break
        while t.decode > 1 and (sd := run(Topology.disaggregated(t.prefill, t.decode - 1))).slo_attainment >= target:
            t, s = Topology.disaggregated(t.prefill, t.decode - 1), sd
        return _Found(t, s)

    @staticmethod
    def _option(found: "_Found", scale: int, rate: float) -> Option:
        t = found.topology
        fleet = Topology(t.colocated * scale, t.prefill * scale, t.decode * scale)
        return Option(fleet, found.summary, rate / fleet.nodes if found.summary else 0.0)


@dataclass(frozen=True, slots=True)
class _Found:
    topology: Topology
    summary: SimSummary | None


def fewest(good: Callable[[int], bool], limit: int) -> int | None:
    """The least k in [1, limit] with good(k), for a good() that stays true once true; None if none.
    Grows by half at a time rather than doubling: attainment is only nearly monotone (a RAG
    replica added cold misses the documents' prefixes), and finer steps miss fewer good sizes."""
    lo, hi = 0, 1
    while not good(hi):
        if hi >= limit:
            return None
        lo, hi = hi, min(max(hi + 1, hi * 3 // 2), limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if good(mid) else (mid, hi)
    return hi
