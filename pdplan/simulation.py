"""A simulated deployment, run once: a profile, a list of requests with their arrival times, and
a topology (colocated replicas, or P prefill + D decode nodes) in, a SimSummary out.

    sim = simulate(profile, requests, Topology.disaggregated(1, 2), SLOTargets(1000, 100))
"""
from __future__ import annotations

from dataclasses import dataclass

from pdplan.colocated import ColocatedPool
from pdplan.decode_pool import DecodePool
from pdplan.events import EventLoop
from pdplan.prefill_pool import PrefillPool
from pdplan.profile import Profile
from pdplan.sim_metrics import SimSummary, summarize
from pdplan.sim_request import SimRequest
from pdplan.sim_router import SimRouter


@dataclass(frozen=True, slots=True)
class Topology:
    colocated: int = 0              # replicas of the whole engine (0: disaggregated)
    prefill: int = 0
    decode: int = 0

    @classmethod
    def disaggregated(cls, prefill: int, decode: int) -> "Topology":
        return cls(0, prefill, decode)

    @property
    def nodes(self) -> int:
        return self.colocated or self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"


@dataclass(frozen=True, slots=True)
class SLOTargets:
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0


def simulate(profile: Profile, requests: list[SimRequest], topology: Topology,
             slo: SLOTargets = SLOTargets(), horizon_s: float = float("inf")) -> SimSummary:
    """Runs every request to its end (or to `horizon_s` past the last arrival: the rest count as
    misses). The requests' timelines are reset first, so a list can be simulated again."""
    for r in requests:
        r.token_times = []
    loop = EventLoop()
    if topology.colocated:
        pool = ColocatedPool(topology.colocated, profile, loop)
        for r in requests:
            loop.at(r.arrival + profile.overheads.request_s, lambda r=r: pool.submit(r))
        busy = {"colocated": (pool.busy_s, topology.colocated)}
        waits = lambda: 0                                     # noqa: E731
        preemptions = pool.preemptions
    else:
        router: SimRouter
        decode = DecodePool(topology.decode, profile, loop, lambda: router.room())
        prefill = PrefillPool(topology.prefill, profile, loop)
        router = SimRouter(loop, prefill, decode, profile.overheads.request_s + profile.overheads.handoff_s)
        for r in requests:
            loop.at(r.arrival, lambda r=r: router.arrive(r))
        busy = {"prefill": (prefill.busy_s, topology.prefill), "decode": (decode.busy_s, topology.decode)}
        waits = lambda: router.waits                          # noqa: E731
        preemptions = decode.preemptions
    loop.run(max(r.arrival for r in requests) + horizon_s)
    return summarize(requests, slo.ttft_ms, slo.tpot_ms, {k: (f(), n) for k, (f, n) in busy.items()},
                     preemptions(), waits())
