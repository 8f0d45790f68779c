"""Decode nodes' prompt steps (>= 16 new tokens in one sequence) against their decode-only steps in
quiet12: wall less thread CPU (the time the step waited for its core), and what processor sharing
with the sibling could give, set beside the sibling's CPU outside its steps (sim23)."""
import glob
import json
import statistics
import sys

from bench.simulate.node_steps import NodeStep, outside_steps

PROMPT = 16


def main(paths):
    """T: the point's wall; p: prompt steps, d: decode-only; exc: wall less CPU; med: median wall / CPU;
    sib busy: the sibling's steps' wall / T; out: CPU outside steps (node_steps.outside_steps)."""
    print(f"{'point':24} {'node':9} {'T':>5} {'n_p':>4} {'p cpu':>6} {'p wall':>6} {'p exc':>6} {'p med':>5} {'d med':>5} {'sib busy':>8} {'sib out':>7} {'own out':>7} {'steal1':>6}")
    for path in paths:
        d = json.load(open(path))
        for system in ("1p1d", "1p2d"):
            for p in d["systems"][system]["points"]:
                T = p["cpu_wall_s"]
                steps = {n: [NodeStep.parse(x) for x in v] for n, v in p["steps"].items()}
                decs = [n for n in steps if n.startswith("decode")]
                for node in decs:
                    mine = steps[node]
                    pr = [s for s in mine if max(n for n, _ in s.shapes) >= PROMPT]
                    de = [s for s in mine if max(n for n, _ in s.shapes) == 1]
                    sib = [n for n in decs if n != node]
                    sib_busy = sum(s.wall_s for s in steps[sib[0]]) / T if sib else 0.0
                    outside = outside_steps(p)
                    sib_out = outside[sib[0]].cpu_s if sib else 0.0
                    own_out = outside[node].cpu_s
                    pc, pw = sum(s.cpu_s for s in pr), sum(s.wall_s for s in pr)
                    pm = statistics.median(s.wall_s / s.cpu_s for s in pr) if pr else float("nan")
                    dm = statistics.median(s.wall_s / s.cpu_s for s in de) if de else float("nan")
                    name = f"{d['sweep']['workload']} {system} {p['rate']}"
                    print(f"{name:24} {node:9} {T:5.0f} {len(pr):4} {pc:6.2f} {pw:6.2f} {pw - pc:6.2f} {pm:5.2f} {dm:5.2f} {sib_busy:8.2f} {sib_out:7.2f} {own_out:7.2f} {p['core_steal_s']['cpu1']:6.1f}")


main(sys.argv[1:] or sorted(glob.glob("bench/validation/quiet12/simulate_measured_*.json")))
