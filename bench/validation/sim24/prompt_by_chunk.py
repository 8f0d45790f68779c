"""sim24: each prompt step's implied prompt factor (validate --node-speed kind's: thread CPU less its
decode part at its node's decode factor, over its prompt part) against the size of its largest chunk,
per point. usage: prompt_by_chunk.py PROFILE MEASURED..."""
import json
import statistics
import sys

from bench.simulate import node_steps
from bench.simulate.node_steps import PROMPT_SHARE, NodeStep
from pdplan.kind_cost import KindCost, KindSpeed
from pdplan.profile import Profile

BINS = ((2, 64), (64, 256), (256, 1024), (1024, 4097))


def main(profile_path, paths):
    cost = Profile.load(profile_path).step
    split = KindCost(cost, KindSpeed(1.0, 1.0))
    for path in paths:
        d = json.load(open(path))
        for system, out in d["systems"].items():
            for p in out["points"]:
                if not p.get("steps"):
                    continue
                speeds = node_steps.kind_speeds(p["steps"], cost)
                by_bin = {b: [] for b in BINS}
                for node, lines in p["steps"].items():
                    for s in map(NodeStep.parse, lines):
                        parts = split.parts(list(s.shapes))
                        dec, pr = parts.decode, parts.prompt
                        if pr < PROMPT_SHARE * (dec + pr):
                            continue
                        n = max(x for x, _ in s.shapes)
                        k = (s.cpu_s - speeds[node].factor.decode * dec) / pr
                        next(v for b, v in by_bin.items() if b[0] <= n < b[1]).append(k)
                cells = "  ".join(f"n {lo}-{hi - 1}: " + (f"{statistics.median(v):.2f} ({len(v)})" if v else "-")
                                  for (lo, hi), v in by_bin.items())
                pooled = statistics.median([k for v in by_bin.values() for k in v])     # main's kind: one prompt factor
                print(f"{d['sweep']['workload']:8} {system:9} {p['rate']:<5} kind prompt {pooled:.2f}  {cells}")


main(sys.argv[1], sys.argv[2:])
