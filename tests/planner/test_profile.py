"""Profiles: the step-cost fit recovers known coefficients, JSON round-trips, and the profiler
measures a real engine (the built-in model) and a real socket."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from pdplan.profile import FEATURES, Profile, StepCost, StepSample, Transfer

TRUE = StepCost(fixed=0.02, per_token=4e-4, per_seq=1e-4, per_decode_ctx=2e-6, per_prefill_pair=1e-7,
                per_prefill_ctx=3e-6)


def synthetic_samples() -> list[StepSample]:
    rng = random.Random(0)
    out = []
    for n in (16, 128, 512, 2048):
        for c in (0, 512, 1024):
            out.append(StepSample([(n, c)], TRUE.of([(n, c)]), "prefill"))
    for b in (1, 4, 16, 64):
        for c in (64, 512, 2048):
            shapes = [(1, c + rng.randrange(8)) for _ in range(b)]
            out.append(StepSample(shapes, TRUE.of(shapes), "decode"))
    return out


def test_fit_recovers_the_coefficients_of_noise_free_steps():
    """Least squares over exact step times gives back the six coefficients."""
    fit = StepCost.fit(synthetic_samples())
    for name in FEATURES:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_a_step_measured_twice_is_priced_at_the_mean_of_its_two_times():
    """Each like step measured twice, once 10% fast and once 10% slow: the fit prices it at the
    middle (the exact coefficients), not at the slower of the two."""
    samples = [StepSample(s.shapes, s.seconds * k, s.kind) for s in synthetic_samples() for k in (0.9, 1.1)]
    fit = StepCost.fit(samples)
    for name in FEATURES:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_fit_never_returns_a_negative_coefficient():
    """A feature that only hurts the fit is dropped (0), never priced negative."""
    samples = [StepSample([(1, 0)] * b, 0.01 + 0.001 * b - 1e-9 * b * b, "decode") for b in range(1, 40)]
    assert all(v >= 0 for v in vars_of(StepCost.fit(samples)))


def vars_of(cost: StepCost) -> list[float]:
    return [getattr(cost, name) for name in FEATURES]


def test_a_prefill_chunk_pays_for_the_cached_context_it_reads():
    """A 16-token chunk over 1,000 cached tokens costs its pairs plus 1,000 context reads; a
    decode step and a chunk with no context pay no context term."""
    ctx_only = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, per_prefill_ctx=1e-6)
    assert ctx_only.of([(16, 1000)]) == pytest.approx(1e-3)
    assert ctx_only.of([(1, 1000), (64, 0)]) == 0.0
    assert TRUE.of([(16, 1000)]) - TRUE.of([(16, 0)]) == pytest.approx(16 * 1000 * 1e-7 + 1000 * 3e-6)


def _written_without(field: str) -> Profile:
    """TRUE's profile as a file written before its step had `field`."""
    d = json.loads(Profile({"cpu": "x"}, {"name": "m"}, 16, 100, 8, 256, TRUE, Transfer(1e-4, 1e-5, 4096)).to_json())
    del d["step"][field]
    return Profile.from_dict(d)


def test_a_profile_written_before_the_context_term_loads_with_it_at_zero():
    """An older file's step has five coefficients: it loads, prices as it did, and refits to six."""
    old = _written_without("per_prefill_ctx")
    assert old.step.per_prefill_ctx == 0.0
    assert old.step.of([(16, 1000)]) == pytest.approx(0.02 + 16 * 4e-4 + 1e-4 + 16 * 1008.5 * 1e-7)


def test_fit_finds_the_floor_of_the_tokens_and_the_sequences_terms():
    """Steps whose linears and LM head cost 4 tokens' and 4 sequences' worth at fewer (the weights'
    read): the fit picks knee 4 from KNEES for both, with the six coefficients; a batch of 1 and
    one of 4 differ by their context reads alone."""
    floor = dataclasses.replace(TRUE, knee_tokens=4.0, knee_seqs=4.0)
    samples = [StepSample(s.shapes, floor.of(s.shapes), s.kind) for s in synthetic_samples()]
    samples += [StepSample([(1, 64)] * b, floor.of([(1, 64)] * b), "decode") for b in (2, 3, 5, 8)]
    fit = StepCost.fit(samples)
    assert (fit.knee_tokens, fit.knee_seqs) == (4.0, 4.0)
    for name in FEATURES:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert floor.of([(1, 0)]) - floor.of([(1, 0)] * 4) == pytest.approx(-3 * 2e-6)   # reads only
    assert floor.of([(1, 0)] * 5) - floor.of([(1, 0)] * 4) == pytest.approx(4e-4 + 1e-4 + 2e-6)
    assert floor.of([(64, 0)]) - floor.of([(63, 0)]) == pytest.approx(4e-4 + 1e-7 * 64)   # one sequence: its floor
    assert floor.scaled(2.0) == dataclasses.replace(floor, **{n: 2 * getattr(floor, n) for n in FEATURES})
    assert floor.of([]) == pytest.approx(0.02)      # no token, no floor: the fixed cost alone


def test_a_profile_written_before_the_floors_loads_without_them():
    """An older file's step has no knee_tokens: it loads with knee 1 (no floor) and prices as it did."""
    old = _written_without("knee_tokens")
    assert old.step.knee_tokens == 1.0
    assert old.step.of([(1, 99)]) == pytest.approx(0.02 + 4e-4 + 1e-4 + 100 * 2e-6)


def test_a_profile_written_with_the_tokens_floor_alone_prices_as_it_did():
    """A file from before knee_seqs (the tokens' floor only, as session 27 wrote them): it loads with
    knee_seqs 1, so a batch of 2 pays two sequences and the tokens' floor of 4."""
    d = json.loads(Profile({"cpu": "x"}, {"name": "m"}, 16, 100, 8, 256, dataclasses.replace(TRUE, knee_tokens=4.0),
                           Transfer(1e-4, 1e-5, 4096)).to_json())
    del d["step"]["knee_seqs"]
    step = Profile.from_dict(d).step
    assert (step.knee_tokens, step.knee_seqs) == (4.0, 1.0)
    assert step.of([(1, 9)] * 2) == pytest.approx(0.02 + 4 * 4e-4 + 2 * 1e-4 + 20 * 2e-6)


def test_profile_json_round_trip(tmp_path):
    """save() then load() gives an equal profile, samples included."""
    p = Profile({"cpu": "x"}, {"name": "m"}, 16, 100, 8, 256, TRUE, Transfer(1e-4, 1e-5, 4096),
                samples=synthetic_samples()[:3])
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_profiler_measures_the_builtin_engine_and_a_socket():
    """A small grid on the built-in model: every experiment yields steps, the fit is usable, the
    transfer of a block takes a positive time, and the machine is recorded, its speed probed on
    the model's linears before and after (pdplan/speed_probe.py) and between the experiments,
    whose steps are priced at one speed (pdplan/speed_sections.py)."""
    from engine.args import EngineArgs
    from pdplan.profiler import ProfileGrid, Profiler
    from pdplan.speed_probe import Speed
    grid = ProfileGrid(prompt_lens=(16, 96), chunk_sizes=(64,), cached_prefixes=(32,), warm_documents=(32,),
                       warm_tails=(8,), warm_repeats=2, batch_sizes=(1, 3),
                       contexts=(24,), decode_steps=2, mixed=((3, 24, 200),),
                       transfer_blocks=8)
    p = Profiler(EngineArgs(dtype="float32", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128),
                 grid, log=lambda *_: None).run()
    kinds = {s.kind for s in p.samples}
    assert kinds == {"prefill", "prefill_cached", "prefill_warm", "decode", "mixed"}
    assert [s.shapes for s in p.samples if s.kind == "prefill_warm"] == [[(8, 32)]] * 2    # the 32 cached
    assert [s.shapes for s in p.samples if s.kind == "prefill"][1:3] == [[(64, 0)], [(32, 64)]]   # 96 in chunks of 64
    assert p.transfer.per_block_s > 0 and p.transfer.block_bytes == p.model["kv_bytes_per_token"] * 16
    assert p.step.fixed + p.step.per_token > 0 and "device" in p.machine and p.num_blocks == 256
    speeds = [Speed.read(p.machine["speed"][when]) for when in ("before", "after")]
    assert all(s.prefill_s > 0 and s.decode_s > 0 for s in speeds)
    sections = p.machine["speed"]["sections"]         # probed between experiments, steps priced at one speed
    assert [r["kinds"] for r in sections] == [["prefill"], ["prefill_cached", "prefill_warm"], ["decode"], ["mixed"]]
    assert sum(r["steps"] for r in sections) == len(p.samples) and all(r["k"] > 0 for r in sections)


def test_the_decode_grid_skips_contexts_past_the_model_and_keeps_the_rest():
    """The default grid reaches 4k tokens of context; a point longer than the engine's model (or
    its pool) is skipped and said so, the others measured at their context."""
    from engine.args import EngineArgs
    from pdplan.profiler import ProfileGrid, Profiler
    assert max(ProfileGrid().contexts) >= 4096
    said = []
    grid = ProfileGrid(batch_sizes=(1, 2), contexts=(24, 200), decode_steps=2, repeats=1)
    profiler = Profiler(EngineArgs(dtype="float32", num_blocks=64, max_num_seqs=4, max_num_batched_tokens=128,
                                   max_model_len=128), grid, log=said.append)
    samples = profiler.decode()
    assert {c for s in samples for _, c in s.shapes} <= set(range(24, 24 + 8))
    assert {len(s.shapes) for s in samples} == {1, 2}
    assert sum("context 200 skipped" in line for line in said) == 2


def test_pool_only_adds_the_named_kinds_of_the_earlier_runs(tmp_path):
    """`pool new old --only prefill_warm`: old's steps all, new's warm steps only, old's other
    fields; the step is refitted over them."""
    from bench.simulate.__main__ import main
    steps = synthetic_samples()
    warm = [StepSample([(16, c)], TRUE.of([(16, c)]), "prefill_warm") for c in (1024, 2048)]
    new = Profile({"cpu": "new"}, {"name": "m"}, 16, 100, 8, 256, TRUE, Transfer(1e-4, 1e-5, 4096),
                  samples=steps[:2] + warm)
    old = Profile({"cpu": "old"}, {"name": "m"}, 16, 100, 8, 256, TRUE, Transfer(1e-4, 1e-5, 4096),
                  samples=steps)
    new.save(tmp_path / "new.json")
    old.save(tmp_path / "old.json")
    main(["pool", str(tmp_path / "new.json"), str(tmp_path / "old.json"), "--only", "prefill_warm",
          "--out", str(tmp_path / "p.json")])
    p = Profile.load(tmp_path / "p.json")
    assert p.samples == warm + steps and p.machine["cpu"] == "old"
    assert p.step.per_prefill_ctx == pytest.approx(TRUE.per_prefill_ctx, rel=1e-6)


def test_mixed_steps_are_measured_at_each_point_of_the_grid():
    """Each (batch, context, prompt) yields steps that prefill a chunk of the prompt beside all the
    batch's decodes (a colocated engine's step), and a point past the pool is skipped, said so."""
    from engine.args import EngineArgs
    from pdplan.profiler import ProfileGrid, Profiler
    said = []
    grid = ProfileGrid(mixed=((3, 24, 200), (2, 48, 100), (8, 200, 100)))
    profiler = Profiler(EngineArgs(dtype="float32", num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64),
                        grid, log=said.append)
    samples = profiler.mixed()
    decoding = sorted({sum(n == 1 for n, _ in s.shapes) for s in samples})
    assert decoding == [2, 3], [s.shapes for s in samples]
    assert all(sum(n > 1 for n, _ in s.shapes) == 1 for s in samples)
    assert {c for s in samples for n, c in s.shapes if n == 1} <= set(range(24, 48 + 16))
    assert sum("skipped" in line for line in said) == 1
    assert sum(n for s in samples for n, _ in s.shapes if n > 1) >= 200 + 100 - 2 * 64


def test_the_profiler_frees_each_engine_before_it_makes_the_next(monkeypatch):
    """One engine at a time over a whole profile (its prefill experiment makes one per chunk size):
    each engine is gone when the next is made, so a GPU node's profile can size its KV pool as the
    node does (an H200's 100 GiB pool was asked for twice: out of memory, session 27)."""
    import weakref

    import engine.llm_engine as llm_engine
    from engine.args import EngineArgs
    from pdplan.profiler import ProfileGrid, Profiler

    made: list[weakref.ref] = []
    real = llm_engine.LLMEngine

    class Checked(real):
        def __init__(self, *args, **kwargs):
            assert [r for r in made if r() is not None] == [], "an earlier engine is still alive"
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))
    monkeypatch.setattr(llm_engine, "LLMEngine", Checked)
    grid = ProfileGrid(prompt_lens=(16, 40), chunk_sizes=(32, 64), cached_prefixes=(32,), warm_documents=(32,),
                       warm_tails=(8,), warm_repeats=1, batch_sizes=(1,), contexts=(24,), decode_steps=2,
                       mixed=((2, 24, 40),), transfer_blocks=4)
    Profiler(EngineArgs(dtype="float32", num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64),
             grid, log=lambda *_: None).run()
    assert len(made) == 6       # two chunk sizes, cached, decode, mixed, the transfer's block size
