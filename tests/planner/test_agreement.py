"""Two profiles made back to back (bench/simulate/agreement.py): pooled only when they agree within
the tolerance per step kind (measured, shape by shape), per feature (what the fits disagree on, as a
share of a step's price) and on the transfer; else each disagreeing figure is named."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench.simulate.agreement import compare, feature_differences, kind_differences
from bench.simulate.__main__ import main
from pdplan.profile import Profile, StepCost, StepSample, Transfer
from tests.planner.test_profile import TRUE, synthetic_samples


def _profile(samples: list[StepSample], step: StepCost = TRUE, per_block_s: float = 1e-4) -> Profile:
    return Profile({"cpu": "x"}, {"name": "m"}, 16, 100, 8, 256, step, Transfer(per_block_s, 1e-5, 4096), samples=samples)


def _slower(samples: list[StepSample], kind: str, k: float) -> list[StepSample]:
    return [replace(s, seconds=s.seconds * k) if s.kind == kind else s for s in samples]


def test_two_runs_alike_agree_and_are_pooled(tmp_path):
    """The same steps twice: every figure 0 off; `pool --agree` writes both runs' steps, refitted."""
    a = _profile(synthetic_samples())
    ok, report = compare(a, a, 0.05)
    assert ok and report.endswith("within 5%: agree")
    assert [d.off for d in kind_differences(a, a)] == [0.0, 0.0]
    a.save(tmp_path / "a.json")
    a.save(tmp_path / "b.json")
    main(["pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--agree", "0.05", "--out", str(tmp_path / "p.json")])
    assert Profile.load(tmp_path / "p.json").samples == a.samples * 2


def test_a_kind_that_ran_slower_is_named_and_nothing_is_written(tmp_path):
    """B's decode steps 10% slower (its fit refitted): the decode kind is +10% shape by shape, the
    prefill kind 0%; the verdict names decode and the features the fits moved; pool writes nothing."""
    a = _profile(synthetic_samples())
    slow = _slower(synthetic_samples(), "decode", 1.1)
    b = _profile(slow, StepCost.fit(slow))
    kinds = {d.name: d for d in kind_differences(a, b)}
    assert kinds["decode"].off == pytest.approx(0.1) and kinds["decode"].count == 12
    assert kinds["prefill"].off == pytest.approx(0.0)
    ok, report = compare(a, b, 0.05)
    assert not ok and "disagree: decode +10.0%" in report
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    with pytest.raises(SystemExit):
        main(["pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--agree", "0.05", "--out", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()
    assert compare(a, b, 0.15)[0]


def test_a_feature_counts_by_its_share_of_the_price():
    """The same steps, B's fit pricing 1 ms more per step: `fixed` is off by 1 ms over each step's
    price (the median over all steps), every other feature by 0; per_prefill_pair only over the
    steps that have pairs. A transfer 20% dearer is named too."""
    samples = synthetic_samples()
    b = _profile(samples, replace(TRUE, fixed=TRUE.fixed + 1e-3), per_block_s=1.2e-4)
    features = {d.name: d for d in feature_differences(_profile(samples), b)}
    prices = sorted((TRUE.of(s.shapes) + b.step.of(s.shapes)) / 2 for s in samples + samples)
    n = len(prices)
    assert features["fixed"].off == pytest.approx((1e-3 / prices[n // 2 - 1] + 1e-3 / prices[n // 2]) / 2)
    assert features["per_token"].off == 0.0
    assert features["per_prefill_pair"].count == 2 * 12 and features["per_decode_ctx"].count == 2 * 12
    ok, report = compare(_profile(samples), b, 0.1)
    assert not ok and "transfer per_block_s +20.0%" in report and "fixed" not in report.split("within")[-1]


def _probed(prefill_s: float | None, decode_s: float = 0.2) -> Profile:
    speed = {} if prefill_s is None else {"speed": {"before": {"prefill_s": prefill_s, "decode_s": decode_s},
                                                    "after": {"prefill_s": prefill_s * 1.5, "decode_s": decode_s}}}
    return replace(_profile(synthetic_samples()), machine={"cpu": "x"} | speed)


def test_a_pooled_profile_carries_the_mean_of_its_runs_probes(tmp_path):
    """Pooled from a run probed at 0.2 s, one at 0.4 s and one with no probe: the pooled profile's
    speed is the two probed runs' mean, before and after apart (not the last run's alone); with
    --only the last run's steps dominate the fit, and its probe is kept as it was."""
    for name, prefill_s in (("a", 0.2), ("b", 0.4), ("c", None)):
        _probed(prefill_s).save(tmp_path / f"{name}.json")
    runs = [str(tmp_path / f"{n}.json") for n in "abc"]
    main(["pool", *runs, "--out", str(tmp_path / "p.json")])
    pooled = Profile.load(tmp_path / "p.json").machine
    assert pooled["pooled_runs"] == 3
    assert pooled["speed"]["before"] == pytest.approx({"prefill_s": 0.3, "decode_s": 0.2})
    assert pooled["speed"]["after"] == pytest.approx({"prefill_s": 0.45, "decode_s": 0.2})
    main(["pool", runs[0], runs[1], "--only", "prefill", "--out", str(tmp_path / "q.json")])
    assert Profile.load(tmp_path / "q.json").machine["speed"]["before"] == pytest.approx({"prefill_s": 0.4, "decode_s": 0.2})
    main(["pool", runs[2], runs[2], "--out", str(tmp_path / "r.json")])
    assert "speed" not in Profile.load(tmp_path / "r.json").machine


def _priced(ref_s: float) -> Profile:
    """A profile whose steps were priced at one speed, its reference ref_s on both probe figures."""
    probe = {"prefill_s": ref_s, "decode_s": ref_s}
    return replace(_profile(synthetic_samples()),
                   machine={"cpu": "x", "speed": {"before": probe, "after": probe, "sections": []}})


def test_runs_priced_at_one_speed_each_are_repriced_at_their_mean(tmp_path):
    """Two one-speed runs at references 0.2 and 0.4 s: pooled at 0.3, the first run's steps take
    1.5x their time and the second's 0.75x; with --only, at the last run's 0.4 (the first's 2x).
    A one-speed run pooled with one whose steps are raw is refused, nothing written."""
    _priced(0.2).save(tmp_path / "a.json")
    _priced(0.4).save(tmp_path / "b.json")
    _probed(0.2).save(tmp_path / "raw.json")
    main(["pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "p.json")])
    pooled, base = Profile.load(tmp_path / "p.json"), synthetic_samples()
    assert [s.seconds for s in pooled.samples] == pytest.approx([s.seconds * 1.5 for s in base] + [s.seconds * 0.75 for s in base])
    assert pooled.machine["speed"]["before"] == pytest.approx({"prefill_s": 0.3, "decode_s": 0.3})
    kind = base[0].kind
    main(["pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--only", kind, "--out", str(tmp_path / "q.json")])
    only = Profile.load(tmp_path / "q.json")
    assert [s.seconds for s in only.samples] == pytest.approx([s.seconds * 2 for s in base if s.kind == kind] + [s.seconds for s in base])
    with pytest.raises(SystemExit):
        main(["pool", str(tmp_path / "a.json"), str(tmp_path / "raw.json"), "--out", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
