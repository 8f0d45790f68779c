"""sim26: a point's decode-only steps by batch size, CPU time over the profile's price (median, steps), per
node: where the linear step model prices small batches. usage: batch_price.py [SET:WORKLOAD:SYSTEM:POINT ...]
(default: mixed colocated 0.5 of quiet15-17 and mixed 1P+1D 0.5 of quiet17)."""
import glob
import json
import statistics
import sys

from pdplan.profile import Profile

DEFAULT = ["quiet15:mixed:colocated:1", "quiet16:mixed:colocated:1", "quiet17:mixed:colocated:1", "quiet17:mixed:1p1d:1"]
MOST = 7        # batches of MOST or more together


def ratios(steps: list[str], profile: Profile) -> dict[int, list[float]]:
    """Batch size -> CPU / price of each decode-only step (a step line: wall cpu q:ctx ... @start)."""
    by: dict[int, list[float]] = {}
    for line in steps:
        parts = line.split()
        shapes = [tuple(map(int, x.split(":"))) for x in parts[2:] if ":" in x]
        if shapes and all(q == 1 for q, _ in shapes):
            by.setdefault(min(len(shapes), MOST), []).append(float(parts[1]) / profile.step.of(shapes))
    return by


def main(specs: list[str]) -> None:
    for spec in specs:
        s, workload, system, i = spec.split(":")
        profile = Profile.load(f"bench/profiles/cpu_1core_llama58m_{s}.json")
        with open(glob.glob(f"bench/validation/{s}/simulate_measured_{workload}_*.json")[0]) as f:
            point = json.load(f)["systems"][system]["points"][int(i)]
        for node, steps in point["steps"].items():
            if node.startswith("prefill"):
                continue
            by = ratios(steps, profile)
            cells = " ".join(f"b{b}{'+' if b == MOST else ''} {statistics.median(v):.2f} ({len(v)})" for b, v in sorted(by.items()))
            print(f"{s} {workload} {system} {point['rate']:g} {node}: {cells}")


main(sys.argv[1:] or DEFAULT)
