"""The machine speed probe (pdplan/speed_probe.py): its figures and their JSON, the probe pinned to a
core in a process of its own, the ratio of two probes, and a validation's k from them
(bench/simulate/probe_price.py; its pricing of a measured run: test_validate.py)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from pdplan.speed_probe import ProbeShape, Speed, probe, probe_cores, record, speed_ratio

SMALL = ProbeShape(prefill_rows=64, decode_rows=4, decode_passes=2, repeats=2)


def _config(model_dir):
    from engine.config import ModelConfig
    return ModelConfig.from_pretrained(model_dir[0], "float32")


def test_the_probe_runs_the_models_linears_as_a_node_packs_them(model_dir):
    """Every linear of the probe is the packed kind pack_linears picks, at the model's shapes
    (qkv: 4 heads + 2 x 2 KV heads of 16), and nothing is left as a plain nn.Linear."""
    from engine.packed_linear import can_pack
    from pdplan.speed_probe import _linears
    cfg = _config(model_dir)
    model = _linears(cfg)
    attn, mlp = model["layers"][0]
    assert len(model["layers"]) == 2
    assert (attn.qkv_proj.in_features, attn.qkv_proj.out_features) == (64, (4 + 2 * 2) * 16)
    assert (mlp.down_proj.in_features, model["lm_head"].out_features) == (128, 512)
    if can_pack(cfg.dtype, torch.device("cpu")):
        assert not any(type(m) is nn.Linear for m in model.modules())


def test_the_probes_figures_are_positive_and_round_trip_through_json(model_dir):
    """Both figures are seconds > 0; a probe written as JSON reads back equal, an error string reads
    as None; the caller's random state is as it was (the profiler probes in its own process)."""
    state = torch.get_rng_state()
    speed = probe(_config(model_dir), SMALL)
    assert torch.equal(torch.get_rng_state(), state)
    assert speed.prefill_s > 0 and speed.decode_s > 0
    assert Speed.read(json.loads(json.dumps(speed.to_dict()))) == speed
    assert Speed.read("timed out after 60 s") is None and Speed.read(None) is None


def test_a_probe_pinned_to_core_0_runs_in_its_own_process(model_dir):
    """probe_cores gives core 0's figures from `python -m pdplan.speed_probe` under taskset; its JSON
    form keys the core as a string."""
    speeds = probe_cores(model_dir[0], "float32", [0], timeout_s=120)
    assert list(speeds) == [0] and isinstance(speeds[0], Speed), speeds
    assert speeds[0].prefill_s > 0 and speeds[0].decode_s > 0
    assert record(speeds) == {"0": speeds[0].to_dict()}


def test_a_probe_that_fails_or_outlives_its_timeout_gives_its_error(tmp_path):
    """A folder with no model exits non-zero, a probe given no time is killed: each core records a
    string, and nothing raises."""
    failed = probe_cores(str(tmp_path), "float32", [0], timeout_s=120)[0]
    assert isinstance(failed, str) and failed.startswith("exit 1: ") and "config.json" in failed
    assert probe_cores(str(tmp_path), "float32", [0], timeout_s=0.01) == {0: "timed out after 0.01 s"}


def test_speed_ratio_is_the_geometric_mean_of_the_two_figures():
    """now / then per figure, multiplied, square-rooted: 1 for equal probes, 2 for both twice as
    slow, sqrt(2 x 8) for one figure 2x and the other 8x, and the inverse the other way round."""
    then = Speed(0.3, 0.05)
    assert speed_ratio(then, then) == 1.0
    assert speed_ratio(Speed(0.6, 0.1), then) == pytest.approx(2.0)
    assert speed_ratio(Speed(0.6, 0.4), then) == pytest.approx(4.0)
    assert speed_ratio(then, Speed(0.6, 0.4)) == pytest.approx(0.25)
    assert speed_ratio(Speed(0.6, 0.05), then) == pytest.approx(math.sqrt(2))


def test_a_profile_made_before_the_probe_loads_and_prices_nothing(tmp_path):
    """A committed profile without machine["speed"] loads; probe_k is None for it however the point
    was probed, and a number once the profile records one (its speed survives save and load)."""
    import os
    from dataclasses import replace
    from bench.simulate.probe_price import probe_k
    from pdplan.profile import Profile
    old = Profile.load(os.path.join(os.path.dirname(__file__), "..", "..", "bench", "profiles",
                                    "cpu_1core_llama58m_quiet3_warm_calibrated.json"))
    assert "speed" not in old.machine
    point = {"speed": {"before": {"0": {"prefill_s": 0.6, "decode_s": 0.1}}, "after": {"0": "exit 1: no"}}}
    assert probe_k(point, old, {"colocated-0": [0]}) is None
    then = {"prefill_s": 0.3, "decode_s": 0.05}
    replace(old, machine=old.machine | {"speed": {"before": then, "after": then}}).save(tmp_path / "p.json")
    new = Profile.load(tmp_path / "p.json")
    assert new.machine["speed"]["after"] == then
    assert probe_k(point, new, {"colocated-0": [0]}) == pytest.approx(2.0)
    assert probe_k(point, new, {"decode-0": [1]}) is None       # core 1 was not probed


def test_a_profile_s_steps_are_priced_at_one_speed():
    """Three experiments; the machine ran at the reference speed (the mean of the first and last
    probes) through the first and slower around the second: the first's steps stay as they were,
    the others' are divided by their k, each section's k is recorded; a probe missing or failed raises."""
    from pdplan.profile import StepSample
    from pdplan.speed_sections import at_one_speed
    fast, slow = {"prefill_s": 1.0, "decode_s": 1.0}, {"prefill_s": 3.0, "decode_s": 3.0}
    ref = {"prefill_s": 2.0, "decode_s": 2.0}
    sections = [[StepSample([(16, 0)], 0.5, "prefill")], [StepSample([(1, 64)], 0.8, "decode")] * 2,
                [StepSample([(1, 64), (64, 0)], 0.3, "mixed")]]
    # probes 2, 2, 3, 2: reference 2; sections' means 2, 2.5, 2.5: k 1, 1.25, 1.25
    samples, record = at_one_speed(sections, [ref, ref, slow, ref])
    assert [r["k"] for r in record] == pytest.approx([1.0, 1.25, 1.25])
    assert [s.seconds for s in samples] == pytest.approx([0.5, 0.64, 0.64, 0.24])
    assert [s.kind for s in samples] == ["prefill", "decode", "decode", "mixed"] and record[1]["steps"] == 2
    samples, record = at_one_speed(sections, [fast, fast, fast, {"prefill_s": 3.0, "decode_s": 3.0}])
    assert record[0]["k"] == pytest.approx(0.5) and samples[0].seconds == pytest.approx(1.0)
    with pytest.raises(ValueError):
        at_one_speed(sections, [ref, ref, ref])
    with pytest.raises(ValueError):
        at_one_speed(sections, [ref, "timed out after 60 s", ref, ref])
