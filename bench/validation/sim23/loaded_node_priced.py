"""sim23: every quiet12 point simulated as validate --node-speed kind prices it, and again with each
pinned core's background load fitted to the point's own schedstat wait / run (contention.py, as
validate --contention does, but on the node-priced simulation), and with it fitted on the shared
cores alone (two nodes pinned there: 1P+2D's core 1; the other cores keep none). Both read the run
they predict: machine speed (steps) and machine load (schedstat), never its TTFT or TPOT.
usage: loaded_node_priced.py PROFILE MEASURED..."""
import sys

from bench.simulate.contention import fit_background, measured_wait
from bench.simulate.validate import FIGURES, TOLERANCE
from bench.validation.sim23.points import points


def errors(sim, metrics):
    return [getattr(getattr(sim, f"{m}_ms"), pct) / metrics[m][pct] - 1 for _, m, pct in FIGURES]


def cell(errs):
    return " / ".join(f"{e:+.0%}" for e in errs) + (" yes" if all(abs(e) <= TOLERANCE for e in errs) else " no")


def main(profile_path, paths):
    counts = [0, 0, 0]
    print("| point | node-priced (kind) | + fitted background | b per core | measured wait / run | + fitted on shared cores only |")
    print("|---|---|---|---|---|---|")
    for pt in points(profile_path, paths, ("colocated", "1p1d", "1p2d")):
        waits = measured_wait(pt.measured, pt.cores)
        b = fit_background(pt.run, waits, pt.cores)
        shared = {c for c in waits if sum(cs[0] == c for cs in pt.cores.values()) > 1}
        m = pt.measured["metrics"]
        plain, loaded = errors(pt.run({}), m), errors(pt.run(b), m)
        only = errors(pt.run({c: v for c, v in b.items() if c in shared}), m) if shared else plain
        for k, errs in enumerate((plain, loaded, only)):
            counts[k] += all(abs(e) <= TOLERANCE for e in errs)
        print(f"| {pt.label} | {cell(plain)} | {cell(loaded)} | "
              f"{', '.join(f'{c}: {v:.2f}' for c, v in sorted(b.items()))} | "
              f"{', '.join(f'{c}: {v:.2f}' for c, v in sorted(waits.items()))} | {cell(only)} |")
    print(f"\nwithin 20%: node-priced {counts[0]} of 18, with the fitted background {counts[1]} of 18, "
          f"fitted on shared cores only {counts[2]} of 18")


main(sys.argv[1], sys.argv[2:])
