"""Each node's CPU outside its engine steps in quiet12's points (node_steps.outside_steps): in seconds,
per second of the point, per token it streamed and per request it decoded (sim23; no new measurement)."""
import glob
import json
import sys

from bench.simulate.node_steps import outside_steps


def main(paths):
    print(f"{'point':24} {'node':12} {'T s':>6} {'out s':>6} {'share':>6} {'reqs':>4} {'toks':>5} {'ms/tok':>6} {'ms/req':>6}")
    for path in paths:
        d = json.load(open(path))
        for system, s in d["systems"].items():
            for p in s["points"]:
                for node, o in outside_steps(p).items():
                    mine = [r for r in p["requests"] if r.get("decode_node", "colocated-0") == node] \
                        if not node.startswith("prefill") else []
                    toks = sum(r["output_tokens"] for r in mine)
                    per_tok = f"{1e3 * o.cpu_s / toks:6.2f}" if toks else f"{'-':>6}"
                    per_req = f"{1e3 * o.cpu_s / len(mine):6.0f}" if mine else f"{'-':>6}"
                    name = f"{d['sweep']['workload']} {system} {p['rate']}"
                    print(f"{name:24} {node:12} {p['cpu_wall_s']:6.1f} {o.cpu_s:6.2f} {o.share:6.1%} {len(mine):4} {toks:5} {per_tok} {per_req}")


main(sys.argv[1:] or sorted(glob.glob("bench/validation/quiet12/simulate_measured_*.json")))
