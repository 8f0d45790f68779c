"""sim23: the simulated 1P+2D decode nodes' prompt steps (>= 16 new tokens in one sequence) against the
measured ones, quiet12, priced as validate --node-speed kind: how many, median wall / price (sim) against
median wall / thread CPU (measured), and the mean wall. Diagnostic: SimEngine's step end is wrapped
here to see each step's shapes and wall (the simulator is not changed).
usage: sim_prompt_steps.py PROFILE MEASURED..."""
import statistics
import sys

from bench.simulate.node_steps import NodeStep
from bench.validation.sim23.points import points
from pdplan import sim_engine

PROMPT = 16
SEEN: list[tuple[str, float, float]] = []      # (node, wall, price) of each simulated prompt step


def watch():
    end = sim_engine.SimEngine._end_step

    def _end_step(self, plan):
        if self.name.startswith("decode") and max(n for _, n in plan) >= PROMPT:
            price = self.profile.step.of([(n, seq.computed) for seq, n in plan])
            SEEN.append((self.name, self.loop.now - self._step_start, price))
        end(self, plan)
    sim_engine.SimEngine._end_step = _end_step


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(profile_path, paths):
    watch()
    for pt in points(profile_path, paths):
        SEEN.clear()
        pt.run()
        meas = [s for n in ("decode-0", "decode-1") for s in map(NodeStep.parse, pt.measured["steps"][n])
                if max(k for k, _ in s.shapes) >= PROMPT]
        print(f"{pt.label}: simulated {len(SEEN)} prompt steps on the decodes, median wall/price "
              f"{median([w / c for _, w, c in SEEN]):.2f}, mean wall {1e3 * statistics.mean(w for _, w, _ in SEEN):.0f} ms; "
              f"measured {len(meas)}, median wall/CPU {median([s.wall_s / s.cpu_s for s in meas]):.2f}, "
              f"mean wall {1e3 * statistics.mean(s.wall_s for s in meas):.0f} ms")


main(sys.argv[1], sys.argv[2:])
