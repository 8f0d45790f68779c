"""bench/simulate/validate.py's diagnostics on a committed measured run (the quiet3 ShareGPT-like
set, its colocated part): each node's measured CPU over its simulated busy time, the point
simulated at that speed, and each figure's range under jitter."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from bench.simulate.validate import FIGURES, point_requests, predict, topology
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate
from pdplan.workload import sim_requests

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURED = os.path.join(HERE, "..", "..", "bench", "validation", "quiet3", "simulate_measured_sharegpt_20261202-004112.json")
PROFILE = os.path.join(HERE, "..", "..", "bench", "profiles", "cpu_1core_llama58m_quiet3_warm_calibrated.json")


def _colocated() -> dict:
    with open(MEASURED) as f:
        measured = json.load(f)
    return measured | {"systems": {"colocated": measured["systems"]["colocated"]}}


def test_a_colocated_point_is_also_simulated_at_the_speed_its_engine_ran():
    """cpu_per_price is the point's schedstat run time over the simulated busy time; at_speed is the
    error of the same point simulated with every step priced that many times its profile price."""
    measured, profile = _colocated(), Profile.load(PROFILE)
    rows = predict(measured, profile, speed=True)
    assert len(rows) == 2
    sweep, out = measured["sweep"], measured["systems"]["colocated"]
    for i, row in enumerate(rows):
        point = out["points"][i]
        reqs = point_requests(sweep, i, point["rate"], profile, point["requests"])
        slo, topo = SLOTargets(sweep["slo"]["ttft_ms"], sweep["slo"]["tpot_ms"]), topology("colocated", out, 2)
        busy = simulate(profile, reqs, topo, slo).node_times["colocated-0"][0]
        k = row["cpu_per_price"]["colocated-0"]
        assert k == pytest.approx(point["cpu"]["colocated-0"]["run_s"] / busy, abs=0.005)
        fast = simulate(replace(profile, step=profile.step.scaled(k)), reqs, topo, slo)
        assert row["TPOT p50"]["at_speed"] == pytest.approx(fast.tpot_ms.p50 / point["metrics"]["tpot"]["p50"] - 1)


def test_each_request_arrives_when_the_load_generator_sent_it():
    """With the point's records, a request arrives at its send_ms (where its measured TTFT starts),
    one sent 200 ms late included; a request never sent (send_ms -1000) keeps its scheduled time."""
    measured, profile = _colocated(), Profile.load(PROFILE)
    sweep, point = measured["sweep"], measured["systems"]["colocated"]["points"][1]
    scheduled = sim_requests("sharegpt", sweep["num_requests"], point["rate"], sweep["seed"] + 1, 16, 4096,
                             output_cap=sweep["output_cap"])
    records = [dict(r) for r in point["requests"]]
    records[7]["send_ms"] = scheduled[7].arrival * 1e3 + 200.0
    records[9]["send_ms"] = -1000.0
    reqs = point_requests(sweep, 1, point["rate"], profile, records)
    assert [r.prompt_len for r in reqs] == [r.prompt_len for r in scheduled]
    assert reqs[7].arrival == pytest.approx(scheduled[7].arrival + 0.2)
    assert reqs[9].arrival == scheduled[9].arrival
    assert reqs[3].arrival == pytest.approx(point["requests"][3]["send_ms"] / 1e3)
    assert [r.arrival for r in point_requests(sweep, 1, point["rate"], profile)] == [r.arrival for r in scheduled]


def test_a_prefill_nodes_cpu_beyond_its_steps_is_a_small_share_of_its_idle_time():
    """cpu_beyond_per_idle is (measured CPU - simulated busy) / (wall - simulated step wall): at
    quiet10's ShareGPT-like 1P+1D 1 req/s the prefill node's is its idle loop's few percent, though
    its cpu_per_price is well above 1."""
    path = os.path.join(HERE, "..", "..", "bench", "validation", "quiet10", "simulate_measured_sharegpt_20261203-064358.json")
    with open(path) as f:
        measured = json.load(f)
    measured["systems"] = {"1p1d": measured["systems"]["1p1d"]}
    profile = Profile.load(os.path.join(HERE, "..", "..", "bench", "profiles", "cpu_1core_llama58m_quiet10.json"))
    row = predict(measured, profile)[1]
    point = measured["systems"]["1p1d"]["points"][1]
    assert row["cpu_per_price"]["prefill-0"] > 1.2
    share = row["cpu_beyond_per_idle"]["prefill-0"]
    busy = point["cpu"]["prefill-0"]["run_s"] / row["cpu_per_price"]["prefill-0"]
    assert 0.0 < share < 0.1
    assert share == pytest.approx((point["cpu"]["prefill-0"]["run_s"] - busy) / (point["cpu_wall_s"] - busy), rel=0.1)
    assert "decode-0" not in row["cpu_beyond_per_idle"]        # busy nearly the whole point


def test_each_figures_jitter_range_holds_the_unjittered_figure():
    """With jitter, every figure has a (low, high) range over the runs that includes the unjittered
    simulation's value, and the runs are not all alike at some figure."""
    rows = predict(_colocated(), Profile.load(PROFILE), jitter=4)
    widths = []
    for row in rows:
        for label, _, _ in FIGURES:
            lo, hi = row[label]["spread"]
            assert lo <= row[label]["simulated"] <= hi
            widths.append(hi - lo)
    assert max(widths) > 0


def test_with_node_speed_the_node_priced_figures_get_their_own_jitter_range():
    """quiet15's ShareGPT-like colocated points recorded their steps: priced by kind of step and
    jittered, each figure's node-priced range holds the unjittered node-priced value, and the
    table shows that range and the verdict it allows beside the node-priced errors."""
    from bench.simulate.sensitivity import verdict
    from bench.simulate.validate import TOLERANCE, markdown
    path = os.path.join(HERE, "..", "..", "bench", "validation", "quiet15", "simulate_measured_sharegpt_20261204-114956.json")
    with open(path) as f:
        measured = json.load(f)
    measured["systems"] = {"colocated": measured["systems"]["colocated"]}
    profile = Profile.load(os.path.join(HERE, "..", "..", "bench", "profiles", "cpu_1core_llama58m_quiet15.json"))
    rows = predict(measured, profile, jitter=3, node_speed="kind")
    assert len(rows) == 2
    for row in rows:
        for label, _, _ in FIGURES:
            lo, hi = row[label]["node_priced_spread"]
            assert lo <= row[label]["node_priced"] <= hi
        cells = markdown([row]).splitlines()[-1].split("|")
        assert cells[-2].strip() == verdict(row, FIGURES, TOLERANCE, "node_priced")
        assert cells[-3].count("[") == len(FIGURES)


def test_a_warm_question_is_measured_once_a_system_and_held_against_the_lowest():
    """The committed quiet3 RAG run: 16 warm questions a point, each with three measured TTFTs (one
    per system, as the file records them) and three simulated; the summary's figures come from them."""
    from bench.simulate.repeat import summary, warm_questions
    path = MEASURED.replace("sharegpt_20261202-004112", "rag_20261202-010216")
    with open(path) as f:
        measured = json.load(f)
    points = warm_questions(measured, Profile.load(PROFILE))
    assert [len(p["questions"]) for p in points] == [16, 16]
    q = points[0]["questions"][0]
    i = next(j for j, r in enumerate(measured["systems"]["colocated"]["points"][0]["requests"]) if r["kind"] == "rag")
    assert q["measured"] == [measured["systems"][s]["points"][0]["requests"][i]["ttft_ms"] for s in ("colocated", "1p1d", "1p2d")]
    assert len(q["simulated"]) == 3 and min(q["simulated"]) > 0
    assert summary(points[0]).startswith("rag 0.15: 16 warm questions")


def test_each_cores_steal_is_read_from_proc_stat_in_seconds():
    """/proc/stat's 8th number per core is its steal in USER_HZ ticks; the machine's total line and
    a kernel that does not count steal (fewer columns) give nothing."""
    from bench.simulate.cpu_time import core_steal
    hz = os.sysconf("SC_CLK_TCK")
    stat = (f"cpu  10 0 5 100 1 0 2 {3 * hz} 0 0\ncpu0 5 0 2 50 0 0 1 {hz} 0 0\n"
            f"cpu1 5 0 3 50 1 0 1 {2 * hz} 0 0\ncpu2 1 2 3 4\nintr 1 2 3\n")
    assert core_steal(stat) == {"cpu0": 1.0, "cpu1": 2.0}
    assert all(v >= 0 for v in core_steal().values())


def _probed(point: dict, before: dict | None, after: dict | None) -> dict:
    """The point with core 0's speed probed before and after it (None: no probe recorded)."""
    return point | ({"speed": {"before": {"0": before}, "after": {"0": after}}} if before or after else {})


def _priced_at(rows: list[dict], measured: dict, profile: Profile, k: float, key: str) -> None:
    """rows[0]'s `key` figures are its point simulated with every step k times dearer (its TPOT above
    the raw one), its raw figures unchanged; rows[1] has none."""
    raw, slow = predict(measured, profile), predict(measured, profile.at_speed(k))
    for label, _, _ in FIGURES:
        assert rows[0][label][key] == pytest.approx(slow[0][label]["simulated"])
        assert rows[0][label]["simulated"] == pytest.approx(raw[0][label]["simulated"])
        assert key not in rows[1][label]
    assert rows[0]["TPOT p50"][key] > rows[0]["TPOT p50"]["simulated"]


def test_a_point_probed_twice_as_slow_as_its_profile_is_priced_at_twice_the_steps():
    """k is speed_ratio(the mean of the point's before and after, the mean of the profile's): 2 for
    a point probed at 1.5x then 2.5x the profile's figures (whose failed after is left out); its probe-priced figures are the point
    simulated with every step 2x dearer (TPOT larger than the raw one), beside the raw error. A
    point with no probe, and a profile with none, give no k and a dash in the table."""
    from bench.simulate.validate import markdown
    measured, profile = _colocated(), Profile.load(PROFILE)
    base = {"prefill_s": 0.3, "decode_s": 0.05}
    probed = replace(profile, machine=profile.machine | {"speed": {"before": base, "after": "timed out after 60 s"}})
    points = measured["systems"]["colocated"]["points"]
    points[0] = _probed(points[0], {"prefill_s": 0.45, "decode_s": 0.075}, {"prefill_s": 0.75, "decode_s": 0.125})
    rows = predict(measured, probed, probe_speed=True)
    assert rows[0]["probe_k"] == pytest.approx(2.0) and rows[1]["probe_k"] is None
    _priced_at(rows, measured, profile, 2.0, "probed")
    table = markdown(rows).splitlines()
    assert "| within 20% | probe k |" in table[0] and table[1].count("---") == 11
    assert " | 2.00 | " in table[2] and table[3].endswith("| - | - | - |")
    assert all(r.get("probe_k") is None for r in predict(measured, profile, probe_speed=True))


def test_a_point_whose_node_stepped_twice_as_slow_is_node_priced_at_twice_its_steps():
    """A colocated point whose recorded steps (node_steps.py) ran at 2x their price on the CPU basis:
    colocated-0's factor is 2.0 over its 40 steps, and its node-priced figures are the point simulated
    with every step 2x dearer, beside the raw ones (unchanged); the point without steps, and a run
    without the flag, get none (a dash in the table)."""
    from bench.simulate.node_steps import NodeStep
    from bench.simulate.validate import markdown
    measured, profile = _colocated(), Profile.load(PROFILE)
    shapes = [((1, 100 + i), (1, 300)) for i in range(40)]
    lines = [NodeStep(5.0, 2.0 * profile.step.of(list(s)), s).line() for s in shapes]
    measured["systems"]["colocated"]["points"][0]["steps"] = {"colocated-0": lines}
    rows = predict(measured, profile, node_speed="cpu")
    factor, steps, source = rows[0]["node_speed"]["colocated-0"]
    assert factor == pytest.approx(2.0, rel=1e-4) and steps == 40 and source == "node"
    assert "node_speed" not in rows[1]
    _priced_at(rows, measured, profile, factor, "node_priced")
    assert all("node_priced" not in r[label] for r in predict(measured, profile) for label, _, _ in FIGURES)
    table = markdown(rows).splitlines()
    assert "| within 20% | node speed (steps) |" in table[0] and table[1].count("---") == 11
    assert "| colocated-0 2.00 (40) | " in table[2] and table[3].endswith("| - | - | - |")


def test_only_a_validation_asks_for_each_measured_figures_interval():
    """sampling=True: each figure carries its bootstrap interval, which holds the measured figure
    (the resampled requests are the point's own); by default (calibrate's searches) none is made."""
    measured, profile = _colocated(), Profile.load(PROFILE)
    assert all("interval" not in row[label] for row in predict(measured, profile) for label, _, _ in FIGURES)
    for row in predict(measured, profile, sampling=True):
        for label, _, _ in FIGURES:
            lo, hi = row[label]["interval"]
            assert lo <= row[label]["measured"] <= hi
