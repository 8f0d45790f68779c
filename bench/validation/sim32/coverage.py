"""sim32: is a measured figure's bootstrap interval (bench/simulate/sampling.py) as wide as a rerun's spread? quiet21
and quiet22 ran the same serving code on the same Zen 4 (bench/README.md, sim31): for each of their 54 figures, does
one set's measured value lie in the other's 90% interval, both ways (108 checks)? Two estimates of one figure differ
by sqrt(2) of one's spread, so an interval as wide as the truth holds the other set's value about 75% of the time;
far fewer would mean the interval is too narrow to judge a miss by. Then the intervals' widths (high / low) by
figure and by requests per point, for every set given (default: quiet21, quiet22, and quiet23 where it exists); and
quiet24 (quiet23's ShareGPT-like and mixed points again) against quiet23, figure by figure.
usage: PYTHONPATH=. python bench/validation/sim32/coverage.py [SET ...]"""
import statistics
import sys

from bench.simulate.sampling import inside, interval, values
from bench.simulate.validate import FIGURES
from bench.validation.sim31.repeatability import measured


def figures(name: str) -> dict[tuple, tuple[float, tuple[float, float], int]]:
    """(workload, system, rate, figure) -> (measured, its 90% interval, requests) of one set."""
    return {key: (p["metrics"][metric][pct], interval(values(p["requests"], metric), pct), len(p["requests"]))
            for key, p, metric, pct in measured(name)}


def main(sets: list[str]) -> None:
    a, b = figures("quiet21"), figures("quiet22")
    checks = [(inside(b[k][0], a[k][1]), k, "quiet22 in quiet21's") for k in a] \
        + [(inside(a[k][0], b[k][1]), k, "quiet21 in quiet22's") for k in b]
    held = sum(ok for ok, _, _ in checks)
    print(f"one code twice (quiet21, quiet22): {held} of {len(checks)} measured figures inside the other set's 90% interval")
    for ok, (workload, system, rate, label), how in checks:
        if not ok:
            one, other = (b, a) if how.startswith("quiet22") else (a, b)
            lo, hi = other[(workload, system, rate, label)][1]
            print(f"  outside: {workload} {system} {rate:g} {label}: {how} [{lo:.1f}..{hi:.1f}], "
                  f"value {one[(workload, system, rate, label)][0]:.1f}")
    for name in sets:
        f = figures(name)
        if not f:
            continue
        for label, _, _ in FIGURES:
            widths = [hi / lo for (_, _, _, lab), (_, (lo, hi), _) in f.items() if lab == label and lo > 0]
            n = sorted({n for (_, _, _, lab), (_, _, n) in f.items() if lab == label})
            print(f"{name} {label} (requests a point {'/'.join(map(str, n))}): interval high / low median "
                  f"{statistics.median(widths):.2f}, max {max(widths):.2f}")

    a, b = figures("quiet23"), figures("quiet24")
    if a and b:
        ratios = sorted((b[k][0] / a[k][0], k) for k in b)
        print(f"quiet24 / quiet23 (one code, 72 requests a point): median {ratios[len(ratios) // 2][0]:.2f}, range "
              f"{ratios[0][0]:.2f} .. {ratios[-1][0]:.2f}; {sum(abs(r - 1) > 0.1 for r, _ in ratios)} of {len(ratios)} "
              f"figures moved more than 10%, {sum(abs(r - 1) > 0.2 for r, _ in ratios)} more than 20%")
        for r, key in ratios[:2]:
            print(f"  {' '.join(map(str, key))}: {a[key][0]:.1f} -> {b[key][0]:.1f} ({r:.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["quiet21", "quiet22", "quiet23"])
