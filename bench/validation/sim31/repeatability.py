"""sim31: how far the real system moves between runs of the same points. The quiet sets measured the same 18 points
(the same workloads, seeds, rates and load generator) on three CPUs: quiet12-14 on the Xeon, quiet15-18 on the
AVX2-only EPYC, quiet19-22 on the Zen 4, the code changing between most of them (each file's pdserve_commit); quiet21
and quiet22 ran the same serving code (0bc367c, and 9736707: the landing copy's C refactored, the same speed). Per CPU,
point and figure (TTFT p50, TTFT p90, TPOT p50): the measured values, and whether any one number lies within 20% of
every one of them (max / min <= 1.2 / 0.8); where none does, no one prediction per point (the simulator's) can
meet the bar on every set of that CPU. Then quiet22 against quiet21, figure by figure.
usage: PYTHONPATH=. python bench/validation/sim31/repeatability.py"""
import glob
import json

from bench.simulate.validate import FIGURES

CPUS = {"Xeon (quiet12-14)": [12, 13, 14], "AVX2 EPYC (quiet15-18)": [15, 16, 17, 18], "Zen 4 (quiet19-22)": [19, 20, 21, 22]}
BAR = 1.2 / 0.8


def measured(name: str):
    """Each measured point of one set (bench/validation/NAME) and figure: ((workload, system, rate, figure), point,
    metric, percentile)."""
    for path in sorted(glob.glob(f"bench/validation/{name}/simulate_measured_*.json")):
        d = json.load(open(path))
        for system, run in d["systems"].items():
            for p in run["points"]:
                for label, metric, q in FIGURES:
                    yield (d["sweep"]["workload"], system, p["rate"], label), p, metric, q


def values(sets: list[int]) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = {}
    for s in sets:
        for key, p, metric, q in measured(f"quiet{s}"):
            out.setdefault(key, []).append(p["metrics"][metric][q])
    return out


def main() -> None:
    total = beyond = 0
    for cpu, sets in CPUS.items():
        rows = values(sets)
        wide = {k: v for k, v in rows.items() if max(v) / min(v) > BAR}
        total, beyond = total + len(rows), beyond + len(wide)
        print(f"## {cpu}: {len(rows)} figures; {len(wide)} moved more than 1.5x between its sets")
        spread = sorted(max(v) / min(v) for v in rows.values())
        print(f"max / min over the sets: median {spread[len(spread) // 2]:.2f}, 90th {spread[int(0.9 * (len(spread) - 1))]:.2f}")
        for (workload, system, rate, name), v in sorted(rows.items(), key=lambda kv: -max(kv[1]) / min(kv[1]))[:8]:
            flag = " **beyond**" if max(v) / min(v) > BAR else ""
            print(f"  {workload} {system} {rate:g} {name}: {' / '.join(f'{x:.0f}' if x >= 100 else f'{x:.1f}' for x in v)}"
                  f" ({max(v) / min(v):.2f}x){flag}")
    print(f"\n{beyond} of {total} figures: no single prediction within 20% of every set of its CPU")
    a, b = values([21]), values([22])
    ratios = sorted((b[k][0] / a[k][0], k) for k in a)
    print(f"\nquiet22 / quiet21 (one code): median {ratios[len(ratios) // 2][0]:.2f}, range {ratios[0][0]:.2f} .. "
          f"{ratios[-1][0]:.2f}; {sum(abs(r - 1) > 0.1 for r, _ in ratios)} of {len(ratios)} figures moved more than 10%, "
          f"{sum(abs(r - 1) > 0.2 for r, _ in ratios)} more than 20%")
    for r, (workload, system, rate, name) in ratios[:3] + ratios[-3:]:
        print(f"  {workload} {system} {rate:g} {name}: {a[(workload, system, rate, name)][0]:.1f} -> "
              f"{b[(workload, system, rate, name)][0]:.1f} ({r:.2f}x)")


if __name__ == "__main__":
    main()
