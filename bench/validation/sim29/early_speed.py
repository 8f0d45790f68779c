"""sim29: is a point's early window slower than the rest of it? Per measured point of the eight
quiet sets: the prefill (or colocated) node's engine steps that prefilled one prompt of 40-300
tokens alone, their median CPU ms a token in the point's first 12 s against after it, beside the
point's node-priced errors in sim28's validate tables (TTFT p50 / TTFT p90 / TPOT p50, within 20%).
A ratio well above 1: the node ran its early steps slower than its later ones of the same kind,
which the node-priced check (one speed a node a point) cannot follow.
usage, from the repository root: python bench/validation/sim29/early_speed.py"""
import glob
import json
import re
import statistics

WINDOW_S, SHORTEST, LONGEST = 12.0, 40, 300


def errors() -> dict:
    out = {}
    for path in glob.glob("bench/validation/sim28/validate_quiet1*.txt"):
        qset = re.search(r"quiet\d+", path).group(0)
        for line in open(path):
            if re.match(r"\| (mixed|rag|sharegpt) ", line):
                r = line.split("|")
                out[(qset, r[1].strip(), r[2].strip(), float(r[3]))] = (r[10].strip(), r[11].strip())
    return out


def cpu_per_token(point: dict) -> tuple[list[float], list[float]]:
    """(early, late): CPU ms a token of the point's lone 40-300-token prefill steps."""
    lines = [line.split() for node, steps in point["steps"].items() if not node.startswith("decode") for line in steps]
    starts = [float(x[1:]) for parts in lines for x in parts if x.startswith("@")]
    t0 = min(starts, default=0.0)
    early, late = [], []
    for parts in lines:
        t = next((float(x[1:]) for x in parts if x.startswith("@")), None)
        pairs = [x.split(":") for x in parts[2:] if not x.startswith("@")]
        if t is None or len(pairs) != 1 or int(pairs[0][1]) != 0:
            continue                    # one prompt from its start, alone in its step
        tokens = int(pairs[0][0])
        if SHORTEST <= tokens <= LONGEST:
            (early if t - t0 < WINDOW_S else late).append(float(parts[1]) / tokens * 1e3)
    return early, late


def main() -> None:
    err, rows = errors(), []
    for qset in sorted({k[0] for k in err}):
        for path in glob.glob(f"bench/validation/{qset}/simulate_measured_*.json"):
            workload = re.search(r"measured_([a-z]+)_", path).group(1)
            for system, out in json.load(open(path))["systems"].items():
                for point in out["points"]:
                    early, late = cpu_per_token(point)
                    key = (qset, workload, system, point["rate"])
                    if early and late and key in err:
                        rows.append((statistics.median(early) / statistics.median(late), key, err[key], len(early), len(late)))
    for ratio, key, (e, ok), n_early, n_late in sorted(rows, key=lambda row: -row[0]):
        print(f"{ratio:5.2f}  {' '.join(map(str, key)):28s} ({n_early} early / {n_late} later steps)  node-priced {e}  "
              f"{'within 20%' if ok == 'yes' else 'MISS'}")


if __name__ == "__main__":
    main()
