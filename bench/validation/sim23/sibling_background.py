"""sim23: would the decode nodes' CPU outside their engine steps, put on their shared core, close the
1P+2D misses? Each 1P+2D point of quiet12 simulated as validate --node-speed kind does, with core 1
given a background load b (pdplan/sim_core.py: b runnable processes that never sleep):
  cal     b = 0.031: a decode node's CPU outside its steps per second of the point, the mean of the
          calibration file's two 1P+1D points (ShareGPT-like: 1.75 s / 54.6 s, 0.97 s / 31.9 s)
  own     b = (out(decode-0) + out(decode-1)) / 2 / T, read from the point itself (an upper bound
          for work spread evenly in time; each step sees its sibling's share)
  both    b = (out(decode-0) + out(decode-1)) / T (both nodes' work against every step)
  1 / 2   b = 1 and 2: what a point would need (for scale; no measured basis)
usage: sibling_background.py PROFILE MEASURED..."""
import sys

from bench.simulate import node_steps
from bench.simulate.validate import FIGURES
from bench.validation.sim23.points import points

CAL_B = 0.031


def main(profile_path, paths):
    print("| point | b: none | cal 0.031 | own | both | 1 | 2 |")
    print("|---|---|---|---|---|---|---|")
    for pt in points(profile_path, paths):
        outside = node_steps.outside_steps(pt.measured)
        own = outside["decode-0"].share + outside["decode-1"].share
        cells = []
        for b in (0.0, CAL_B, own / 2, own, 1.0, 2.0):
            sim = pt.run({1: b})
            errs = [getattr(getattr(sim, f"{m}_ms"), pct) / pt.measured["metrics"][m][pct] - 1 for _, m, pct in FIGURES]
            cells.append(f"b {b:.3f}: " + " / ".join(f"{e:+.0%}" for e in errs))
        print(f"| {pt.label} | " + " | ".join(cells) + " |")


main(sys.argv[1], sys.argv[2:])
