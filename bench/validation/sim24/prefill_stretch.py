"""sim24: how much a long prompt chunk's step on prefill-0 is stretched beyond its own work, measured
(its wall / its thread CPU) against simulated (its wall / its price: the floating router's and client's
work placed on core 0 beside it, sim_core.py), per 1P+1D / 1P+2D point, validate --node-speed kind's
pricing. usage: prefill_stretch.py PROFILE MEASURED..."""
import json
import statistics
import sys

from bench.simulate import node_steps
from bench.simulate.node_steps import NodeStep
from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan import sim_engine
from pdplan.kind_cost import LONG_CHUNK
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate

STEPS: list[tuple[str, float, float]] = []      # (node, wall, price) of each simulated step with a long chunk


def watch():
    kick, end = sim_engine.SimEngine.kick, sim_engine.SimEngine._end_step
    open_: dict[int, tuple[float, float]] = {}

    def _kick(self):
        was, busy = self.stepping, self.busy_s
        kick(self)
        if self.stepping and not was:
            open_[id(self)] = (self.loop.now, busy)

    def _end(self, plan):
        t0, busy0 = open_.pop(id(self))
        if any(n >= LONG_CHUNK for _, n in plan):
            STEPS.append((self.name, self.loop.now - t0, self.busy_s - busy0))
        end(self, plan)
    sim_engine.SimEngine.kick, sim_engine.SimEngine._end_step = _kick, _end


def main(profile_path, paths):
    watch()
    profile = Profile.load(profile_path)
    for path in paths:
        d = json.load(open(path))
        sweep = d["sweep"]
        for system, out in d["systems"].items():
            if system == "colocated":
                continue
            for i, p in enumerate(out["points"]):
                STEPS.clear()
                reqs = point_requests(sweep, i, p["rate"], profile, p.get("requests"))
                speed = node_steps.speed_map(p.get("steps"), profile.step, "kind")
                simulate(profile, reqs, topology(system, out, d["machine"]["nproc"]), SLOTargets(), ranked_before=ranked_before(out, i),
                         speed=speed)
                meas = [s.wall_s / s.cpu_s for s in map(NodeStep.parse, p["steps"].get("prefill-0", []))
                        if any(n >= LONG_CHUNK for n, _ in s.shapes)]
                sim = [w / b for node, w, b in STEPS if node == "prefill-0"]
                if meas and sim:
                    print(f"{sweep['workload']:8} {system} {p['rate']:<5} prefill-0 long steps: wall / own work measured "
                          f"{statistics.median(meas):.2f} ({len(meas)}, max {max(meas):.2f}), simulated "
                          f"{statistics.median(sim):.2f} ({len(sim)}, max {max(sim):.2f})")


main(sys.argv[1], sys.argv[2:])
