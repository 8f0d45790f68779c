"""sim27: a profile's step cost fitted again from its own samples as pdplan/profile.py fits now (the
tokens term's floor, knee_tokens, chosen with the rest); prints the knee and the median fit error
before and after, by decode batch the median of measured / priced (batches 1-16).
usage: python bench/validation/sim27/refit.py PROFILE OUT"""
import statistics
import sys
from dataclasses import replace

from pdplan.profile import Profile, StepCost

src, out = sys.argv[1:3]
before = Profile.load(src)
after = replace(before, step=StepCost.fit(before.samples))
after.save(out)


def by_batch(profile: Profile) -> str:
    by: dict[int, list[float]] = {}
    for s in profile.samples:
        if all(n == 1 for n, _ in s.shapes) and len(s.shapes) <= 16:
            by.setdefault(len(s.shapes), []).append(s.seconds / profile.step.of(s.shapes))
    return " ".join(f"b{b} {statistics.median(v):.2f}" for b, v in sorted(by.items()))


print(f"{src}: knee {before.step.knee_tokens:g} -> {after.step.knee_tokens:g}, median fit error "
      f"{before.fit_error():.1%} -> {after.fit_error():.1%}\n  measured/priced before: {by_batch(before)}\n"
      f"  after:                  {by_batch(after)}")
