"""A simulated deployment, run once: a profile, a list of requests with their arrival times, and
a topology (colocated replicas, or P prefill + D decode nodes; each node on a core of its own
unless pinned to share one) in, a SimSummary out.

    sim = simulate(profile, requests, Topology.disaggregated(1, 2), SLOTargets(1000, 100))
    Topology.disaggregated(1, 2).pinned({"prefill-0": {0}, "decode-0": {1}, "decode-1": {1}})
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pdplan.colocated import ColocatedPool
from pdplan.decode_pool import DecodePool
from pdplan.events import EventLoop
from pdplan.prefill_pool import PrefillPool
from pdplan.profile import Profile
from pdplan.sim_core import CoreMap
from pdplan.sim_metrics import SimSummary, summarize
from pdplan.sim_request import SimRequest
from pdplan.sim_router import SimRouter
from pdplan.slo import SLOTargets

__all__ = ["SLOTargets", "Topology", "simulate"]


@dataclass(frozen=True, slots=True)
class Topology:
    colocated: int = 0              # replicas of the whole engine (0: disaggregated)
    prefill: int = 0
    decode: int = 0
    pins: tuple[tuple[str, int], ...] = ()  # (node name, core id): names on one id share a core; others own one
    machine_cores: int = 0          # the pinned nodes' machine has these cores (ids 0..n-1): unpinned work
                                    # (router, load generator) runs on them (sim_core.py); 0: separate hosts

    @classmethod
    def disaggregated(cls, prefill: int, decode: int) -> "Topology":
        return cls(0, prefill, decode)

    def pinned(self, cores: dict[str, set[int]], machine_cores: int = 0) -> "Topology":
        """This topology with nodes pinned as bench/simulate/pinning.py pins the real ones
        ({"decode-0": {1}, "decode-1": {1}}: one core each, the same one here), on a machine of
        `machine_cores` cores (0: unpinned work is not simulated)."""
        if any(len(c) != 1 for c in cores.values()):
            raise ValueError(f"a simulated node runs on exactly one core: {cores}")
        if machine_cores and any(next(iter(c)) >= machine_cores for c in cores.values()):
            raise ValueError(f"a node pinned past the machine's {machine_cores} cores: {cores}")
        return replace(self, pins=tuple(sorted((node, next(iter(c))) for node, c in cores.items())),
                       machine_cores=machine_cores)

    def shared(self) -> list[list[str]]:
        """The groups of nodes that share a core (two or more)."""
        groups: dict[int, list[str]] = {}
        for node, core in self.pins:
            groups.setdefault(core, []).append(node)
        return [g for g in groups.values() if len(g) > 1]

    @property
    def nodes(self) -> int:
        return self.colocated or self.prefill + self.decode

    def __str__(self) -> str:
        name = f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"
        return name + "".join(f" ({'+'.join(g)} on one core)" for g in self.shared())


def simulate(profile: Profile, requests: list[SimRequest], topology: Topology,
             slo: SLOTargets = SLOTargets(), horizon_s: float = float("inf"), warmup_s: float = 0.0,
             background: dict[int, float] | None = None, ranked_before: int = 0,
             speed: dict[str, float] | None = None) -> SimSummary:
    """Runs every request to its end (or to `horizon_s` past the last arrival: the rest count as
    misses). The requests' timelines are reset first, so a list can be simulated again. Requests
    arriving before warmup_s run (they fill prefix caches and queues) but are not scored.
    background: pinned core id -> other work's runnable processes there (sim_core.py).
    ranked_before: requests the router had ranked before these (decode_pool.py: its coin).
    speed: node name ("decode-1") -> that node's steps priced this many times the profile's (a node
    not named: 1.0); each node then has a step cost of its own."""
    for r in requests:
        r.token_times = []
    loop = EventLoop()
    cores = CoreMap(loop, topology.pins, background, topology.machine_cores, profile.overheads.beside_prefill)
    if topology.colocated:
        # pinned on a machine (the validation), the server's front end shares its engine's core with the
        # steps; on hosts of their own (a plan) a front end has cores to spare
        on_core = profile.overheads.front_cpu_token_s if topology.machine_cores else 0.0
        pool = ColocatedPool(topology.colocated, profile, loop, cores, speed, front_token_s=on_core)
        for r in requests:
            loop.at(r.arrival + profile.overheads.front_s(r.prompt_len) - on_core * r.prompt_len,
                    lambda r=r: pool.submit(r))
        busy = {"colocated": (pool.busy_s, topology.colocated)}
        nodes = pool.nodes
        waits = lambda: 0                                     # noqa: E731
        preemptions = pool.preemptions
    else:
        router: SimRouter
        decode = DecodePool(topology.decode, profile, loop, lambda: router.room(), cores, ranked_before=ranked_before,
                            speed=speed)
        prefill = PrefillPool(topology.prefill, profile, loop, cores, speed)
        router = SimRouter(loop, prefill, decode, profile.overheads.request_s, profile.overheads.handoff_s,
                           prompt_token_s=profile.overheads.prompt_token_s + profile.overheads.admit_token_s)
        for r in requests:
            loop.at(r.arrival, lambda r=r: router.arrive(r))
        busy = {"prefill": (prefill.busy_s, topology.prefill), "decode": (decode.busy_s, topology.decode)}
        nodes = prefill.nodes + decode.nodes
        waits = lambda: router.waits                          # noqa: E731
        preemptions = decode.preemptions
    o = profile.overheads
    cores.floating.steady(loop, o.client_per_s + (0.0 if topology.colocated else o.router_per_s),
                          unfinished_left(requests))
    loop.run(max(r.arrival for r in requests) + horizon_s)
    summary = summarize(requests, slo, {k: (f(), n) for k, (f, n) in busy.items()}, preemptions(), waits(), warmup_s)
    return replace(summary, node_times={n.engine.name: (n.engine.busy_s + n.engine.core.bus_cpu.get(n.engine.name, 0.0),
                                                        n.engine.wall_s) for n in nodes})


def unfinished_left(requests: list[SimRequest]) -> Callable[[], bool]:
    """A check of whether any request is neither done nor failed, asked every few simulated ms: it
    goes on from the first request it last found unfinished (a request never unfinishes), so a
    whole run's checks read each request about once, not every request at every tick."""
    first = 0

    def check() -> bool:
        nonlocal first
        while first < len(requests) and (requests[first].done or requests[first].failed):
            first += 1
        return first < len(requests)
    return check
