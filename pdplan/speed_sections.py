"""A profile's steps priced at one machine speed: the profiler probes the machine's speed
(pdplan/speed_probe.py) between its experiments, and each experiment's steps are scaled by the
speed it ran at against the profile's reference (the mean of the first and last probes, what
`validate --probe-speed` compares a measured point's probes with).

Why: this host's speed drifts within minutes. Profile quiet10 (bench/profiles/
cpu_1core_llama58m_quiet10.json, 06:31-06:36 UTC 2026-12-03, nothing else running) probed
prefill_s 0.246 s before and 0.347 s after (decode_s 0.196 / 0.225): the machine slowed by a
quarter during the profile, so its prefill steps (measured first) and its decode and mixed steps
(measured later) were priced at different speeds, which no single before / after pair can undo.

    section k = speed_ratio(the mean of the probes before and after the section, reference)
    a step's seconds / k        (k > 1: the machine ran slower than the reference then)
"""
from __future__ import annotations

from pdplan.profile import StepSample
from pdplan.speed_probe import Speed, speed_ratio


def at_one_speed(sections: list[list[StepSample]], probes: list[dict]) -> tuple[list[StepSample], list[dict]]:
    """sections: each experiment's steps in the order run; probes: len(sections) + 1 probe records
    (Speed dicts), probes[i] taken before sections[i] and probes[i + 1] after it. Returns every
    step scaled to the reference speed, and one record a section: its kinds, steps and k."""
    if len(probes) != len(sections) + 1:
        raise ValueError(f"{len(sections)} sections need {len(sections) + 1} probes, got {len(probes)}")
    speeds = [Speed.read(p) for p in probes]
    if not all(speeds):
        raise ValueError("a probe failed: the steps cannot be priced at one speed")
    reference = Speed.mean([speeds[0], speeds[-1]])
    samples, record = [], []
    for i, steps in enumerate(sections):
        k = speed_ratio(Speed.mean(speeds[i:i + 2]), reference)
        samples += [StepSample(s.shapes, s.seconds / k, s.kind) for s in steps]
        record.append({"kinds": sorted({s.kind for s in steps}), "steps": len(steps), "k": k,
                       "after": probes[i + 1]})
    return samples, record
