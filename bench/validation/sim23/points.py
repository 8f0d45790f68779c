"""sim23's scripts: each measured point, simulated as validate --node-speed kind prices it."""
import json
from typing import Callable, Iterator, NamedTuple

from bench.simulate import node_steps
from bench.simulate.pinning import PINS
from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate


class Point(NamedTuple):
    label: str                  # "rag 1p2d 0.3"
    measured: dict              # the measure file's point
    cores: dict                 # node -> its cores, as the run pinned them
    reqs: list                  # its requests (SimRequest), as sent
    run: Callable               # run(background={core: b}) -> SimSummary, node-priced (kind)


def points(profile_path: str, paths: list[str], systems: tuple[str, ...] = ("1p2d",)) -> Iterator[Point]:
    profile = Profile.load(profile_path)
    for path in paths:
        d = json.load(open(path))
        sweep = d["sweep"]
        for system, out in d["systems"].items():
            if system not in systems:
                continue
            for i, p in enumerate(out["points"]):
                reqs = point_requests(sweep, i, p["rate"], profile, p.get("requests"))
                topo = topology(system, out, d["machine"]["nproc"])
                slo = SLOTargets(sweep["slo"]["ttft_ms"], sweep["slo"]["tpot_ms"])
                speed = node_steps.speed_map(p.get("steps"), profile.step, "kind")
                before = ranked_before(out, i)

                def run(background=None, reqs=reqs, topo=topo, slo=slo, speed=speed, before=before):
                    return simulate(profile, reqs, topo, slo, background=background, ranked_before=before, speed=speed)
                yield Point(f"{sweep['workload']} {system} {p['rate']}", p, out.get("cores") or PINS[system], reqs, run)
