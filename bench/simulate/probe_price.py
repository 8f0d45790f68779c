"""The speed probe's correction of a validation (validate.py --probe-speed): a measured point's
simulated steps priced at the speed the machine had while the point ran, against the speed it had
while the profile was made. pdplan/speed_probe.py measures both: measure.py records each pinned
core's before and after every point, the profiler its own core before and after the profile."""
from __future__ import annotations

import statistics
from dataclasses import replace

from pdplan.profile import Profile, StepSample
from pdplan.speed_probe import Speed, speed_ratio


def probe_k(point: dict, profile: Profile, cores: dict[str, list[int]]) -> float | None:
    """The price multiplier of the point's steps: the mean over the cores its nodes are pinned to
    (`cores`: node -> cores) of speed_ratio(the point's probe of that core, the profile's), each
    probe the mean of its before and after (or the one of them that worked); None where the point
    or the profile recorded no probe that worked."""
    speed = profile.machine.get("speed") or {}
    then = _mean([speed.get("before"), speed.get("after")])
    probes = point.get("speed") or {}
    ratios = []
    for core in sorted(set().union(*map(set, cores.values()))):
        now = _mean([(probes.get(when) or {}).get(str(core)) for when in ("before", "after")])
        if now and then:
            ratios.append(speed_ratio(now, then))
    return statistics.fmean(ratios) if ratios else None


def one_speed_runs(runs: list[Profile], last_only: bool) -> tuple[list[list[StepSample]], dict] | None:
    """Runs whose steps each priced at their own reference speed (pdplan/speed_sections.py),
    repriced at one: the mean of their references (last_only: the last run's, whose steps all
    go in), each run's seconds times speed_ratio(that, its reference). Returns every run's
    repriced steps and the pooled profile's speed record; None where no run was priced at one
    speed. Raises ValueError where some were and some were not (--raw-steps, or older)."""
    speeds = [run.machine.get("speed") or {} for run in runs]
    priced = ["sections" in sp for sp in speeds]
    if not any(priced):
        return None
    if not all(priced):
        raise ValueError("some profiles priced their steps at one speed and some did not (--raw-steps, "
                         "or made before pdplan/speed_sections.py): pool profiles made alike")
    refs = [Speed.mean([Speed.read(sp["before"]), Speed.read(sp["after"])]) for sp in speeds]
    to = refs[-1] if last_only else Speed.mean(refs)
    steps = [[replace(s, seconds=s.seconds * speed_ratio(to, ref)) for s in run.samples] for run, ref in zip(runs, refs)]
    return steps, {"before": to.to_dict(), "after": to.to_dict(), "pooled": [r.to_dict() for r in refs]}


def pooled_speed(machines: list[dict]) -> dict | None:
    """The `speed` record of a profile pooled from runs with these `machine` dicts: the mean of
    every run's probes that worked, before and after apart (each run's steps weigh alike in the
    refit, so each run's speed does too); None where no run recorded one that worked."""
    pooled = {when: _mean([(m.get("speed") or {}).get(when) for m in machines]) for when in ("before", "after")}
    return {when: s.to_dict() for when, s in pooled.items() if s} or None


def _mean(records) -> Speed | None:
    """The mean of the recorded probes that worked (a failed one is its error string), or None."""
    speeds = [s for s in map(Speed.read, records) if s]
    return Speed.mean(speeds) if speeds else None
