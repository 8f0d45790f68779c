"""The simulator schedules as a node run with --long-prefill-token-threshold: a prompt's tokens per
step capped, so a short prompt beside a long one waits for one capped chunk; profiles keep the cap,
and validate simulates a measured server with the cap its command line set."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.simulate.validate import served_as
from pdplan.profile import Profile, StepCost, Transfer
from pdplan.sim_request import SimRequest, chain_hashes
from pdplan.simulation import Topology, simulate

STEP = StepCost(fixed=0.010, per_token=0.001, per_seq=0.0005, per_decode_ctx=1e-5, per_prefill_pair=0.0)


def profile(cap: int = 0) -> Profile:
    return Profile({}, {}, 16, 1024, 64, 2048, STEP, Transfer(0.002, 0.0005, 1 << 19),
                   long_prefill_token_threshold=cap)


def request(rid: int, n: int, start: int, at: float) -> SimRequest:
    return SimRequest(rid, at, n, 4, chain_hashes(tuple(range(start, start + n)), 16))


def test_a_short_prompt_beside_a_long_one_waits_for_one_capped_chunk():
    """A 40-token prompt arrives 1 ms into a 3,000-token prompt's first step. Uncapped, that step is
    2,048 tokens of the long prompt and the short one's first token also waits for the next (the
    long prompt's last 952 tokens beside its 40); capped at 256, the first step is 256 tokens and
    the next 256 beside 40. The long prompt's first token comes later (12 chunks, each with its own
    fixed cost, instead of 2)."""
    runs = {}
    for cap in (0, 256):
        long, short = request(0, 3000, 3, 0.0), request(1, 40, 5000, 0.001)
        simulate(profile(cap), [long, short], Topology(colocated=1))
        runs[cap] = long, short
    uncapped = STEP.of([(2048, 0)]) + STEP.of([(952, 2048), (40, 0)])
    capped = STEP.of([(256, 0)]) + STEP.of([(256, 256), (40, 0)])
    assert runs[0][1].ttft == pytest.approx(uncapped - 0.001)
    assert runs[256][1].ttft == pytest.approx(capped - 0.001)
    assert runs[256][0].ttft > runs[0][0].ttft + 10 * STEP.fixed


def test_profiles_keep_the_cap_and_validate_reads_it_off_the_measured_server(tmp_path):
    """A profile's cap survives its JSON (an older profile, without the key, loads uncapped);
    validate takes a measured server's `--long-prefill-token-threshold N` (or `=N`) as the
    simulated nodes' cap, and leaves the profile's where the command line sets none."""
    path = tmp_path / "p.json"
    profile(128).save(str(path))
    assert Profile.load(str(path)).long_prefill_token_threshold == 128
    older = json.loads(path.read_text())
    del older["long_prefill_token_threshold"]
    assert Profile.from_dict(older).long_prefill_token_threshold == 0
    base = profile()
    argv = ["pdserve", "colocated", "--long-prefill-token-threshold", "256"]
    assert served_as(base, argv).long_prefill_token_threshold == 256
    assert served_as(base, ["--long-prefill-token-threshold=64"]).long_prefill_token_threshold == 64
    kept = replace(base, long_prefill_token_threshold=32)
    assert served_as(kept, ["--max-num-seqs", "8"]).long_prefill_token_threshold == 32
