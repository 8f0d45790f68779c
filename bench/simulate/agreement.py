"""Two profiles of one machine made back to back (`pdserve profile` twice, the same grid): did the
machine run at one speed through both? A profile made while the machine's speed moves (a fresh
boot, another guest on the host, a neighbour's benchmark) prices every later simulation wrong, and
two profiles of this machine an hour apart have differed by 6-17% (bench/README.md, plan6/plan7).

    python -m bench.simulate pool A.json B.json --agree 0.05 --out P.json

compares them, and writes the pooled profile (both runs' steps, refitted) only if they agree within
the tolerance at every figure below; else it says which disagree, by how much, and writes nothing:

  step kinds   per kind of step (prefill, prefill_cached, prefill_warm, decode, mixed): the median,
               over the step shapes both runs measured, of B's measured seconds over A's (each
               shape's median), less 1
  features     per step feature (pdplan/profile.py FEATURES): what the two fits' coefficients
               disagree on as a share of a step's price, |b - a| * x / price (x: the step's value of
               the feature; price: the two fits' mean), the median over the steps with x > 0. A
               coefficient that weighs little in every step may differ much and pass; two that
               trade places (per_token and per_seq price a decode batch alike) show at both
  transfer     per_block_s, B over A, less 1
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from pdplan.profile import FEATURES, Profile, step_features

TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class Difference:
    """One compared figure: what it is, A's and B's values, and the difference the verdict reads."""
    name: str
    a: float
    b: float
    off: float          # signed: B against A (a share of the price for a feature)
    count: int          # step shapes (kinds) or steps using it (features); 1 for the transfer


def kind_differences(a: Profile, b: Profile) -> list[Difference]:
    """Per step kind, B's measured seconds over A's for the shapes both measured (a and b: the
    medians of the kind's per-shape medians, in seconds)."""
    ma, mb = _by_shape(a), _by_shape(b)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for key in ma.keys() & mb.keys():
        kinds.setdefault(key[0], []).append((ma[key], mb[key]))
    return [Difference(kind, statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs),
                       statistics.median(y / x for x, y in pairs) - 1, len(pairs))
            for kind, pairs in sorted(kinds.items())]


def feature_differences(a: Profile, b: Profile) -> list[Difference]:
    """Per feature of the step cost, the share of a step's price the two fits disagree on (signed:
    B's coefficient above A's is positive), over both runs' steps."""
    rows = [(step_features(s.shapes), (a.step.of(s.shapes) + b.step.of(s.shapes)) / 2) for s in a.samples + b.samples]
    out = []
    for i, name in enumerate(FEATURES):
        ca, cb = getattr(a.step, name), getattr(b.step, name)
        shares = [(cb - ca) * x[i] / price for x, price in rows if x[i] > 0 and price > 0]
        off = statistics.median(shares) if shares else 0.0
        out.append(Difference(name, ca, cb, off, len(shares)))
    return out


def transfer_difference(a: Profile, b: Profile) -> Difference:
    pa, pb = a.transfer.per_block_s, b.transfer.per_block_s
    return Difference("transfer per_block_s", pa, pb, pb / pa - 1 if pa > 0 else 0.0, 1)


def compare(a: Profile, b: Profile, tolerance: float = TOLERANCE) -> tuple[bool, str]:
    """(whether every figure is within `tolerance`, the report)."""
    kinds, features, transfer = kind_differences(a, b), feature_differences(a, b), transfer_difference(a, b)
    if not kinds:
        raise ValueError("the two profiles measured no step shape in common: not two runs of one grid")
    lines = ["| step kind | shapes both measured | A median ms | B median ms | B / A - 1 (median per shape) |",
             "|---|---|---|---|---|"]
    lines += [f"| {d.name} | {d.count} | {d.a * 1e3:.2f} | {d.b * 1e3:.2f} | {d.off:+.1%} |" for d in kinds]
    lines += ["", "| feature | A | B | B - A, share of a step's price (median) | steps using it |", "|---|---|---|---|---|"]
    lines += [f"| {d.name} | {d.a:.4g} | {d.b:.4g} | {d.off:+.1%} | {d.count} |" for d in features]
    lines += [f"| {transfer.name} | {transfer.a:.4g} | {transfer.b:.4g} | {transfer.off:+.1%} (B / A - 1) | - |"]
    bad = [d for d in kinds + features + [transfer] if abs(d.off) > tolerance]
    verdict = "agree" if not bad else "disagree: " + ", ".join(f"{d.name} {d.off:+.1%}" for d in bad)
    lines += ["", f"within {tolerance:.0%}: {verdict}"]
    return not bad, "\n".join(lines)


def _by_shape(p: Profile) -> dict[tuple, float]:
    """(kind, shapes) -> the median seconds of that profile's steps of that shape."""
    seen: dict[tuple, list[float]] = {}
    for s in p.samples:
        seen.setdefault((s.kind, tuple(map(tuple, s.shapes))), []).append(s.seconds)
    return {key: statistics.median(v) for key, v in seen.items()}
