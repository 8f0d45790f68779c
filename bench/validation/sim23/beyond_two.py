"""sim23: the steps of the 1P+2D decode nodes in quiet12 that waited for their core more than one sibling
step could make them: wall / thread CPU of the prompt steps (>= 16 new tokens) and the decode-only steps
(sums), and the time beyond 2x their CPU, beside the floating work (router, client) and core 1's steal."""
import glob
import json
import sys

from bench.simulate.node_steps import NodeStep


def beyond(steps):
    """(wall / CPU over the steps, seconds of wall beyond twice each step's CPU, wall)."""
    wall, cpu = sum(s.wall_s for s in steps), sum(s.cpu_s for s in steps)
    return wall / cpu if cpu else 0.0, sum(max(0.0, s.wall_s - 2 * s.cpu_s) for s in steps), wall


def main(paths):
    for path in paths:
        d = json.load(open(path))
        for p in d["systems"]["1p2d"]["points"]:
            floating = p["float_cpu"]["router"]["run_s"] + p["float_cpu"]["client"]["run_s"]
            for node in ("decode-0", "decode-1"):
                st = [NodeStep.parse(x) for x in p["steps"][node]]
                pr = beyond([s for s in st if max(n for n, _ in s.shapes) >= 16])
                de = beyond([s for s in st if max(n for n, _ in s.shapes) == 1])
                print(f"{d['sweep']['workload']:8} {p['rate']:5} {node}: prompt wall/cpu (sums) {pr[0]:.2f} beyond 2x "
                      f"{pr[1]:.2f}s of {pr[2]:.2f}s; decode-only {de[0]:.2f} beyond 2x {de[1]:.2f}s of {de[2]:.2f}s; "
                      f"float run {floating:.1f}s steal1 {p['core_steal_s']['cpu1']}")


main(sys.argv[1:] or sorted(glob.glob("bench/validation/quiet12/simulate_measured_*.json")))
