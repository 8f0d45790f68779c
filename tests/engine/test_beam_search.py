"""Beam search: transformers' beams token for token; beams share blocks, copy on write only."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams


def _hf_beams(hf, prompt, width, max_new, **kw) -> list[list[int]]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, num_beams=width,
                      num_return_sequences=width, do_sample=False, eos_token_id=2, pad_token_id=0, **kw)
    rows = [r[len(prompt):].tolist() for r in out]
    return [r[: r.index(2) + 1] if 2 in r else r for r in rows]


@pytest.mark.parametrize("width,length_penalty,early_stopping",
                         [(2, 1.0, False), (4, 1.0, False), (4, 0.5, True), (3, 2.0, "never")])
def test_beams_equal_transformers(model_dir, make_llm, width, length_penalty, early_stopping):
    """Every returned beam, in order, equals transformers' beam search (same width, length
    penalty and early stopping, float32)."""
    path, hf = model_dir
    llm = make_llm(path, block_size=8, num_blocks=128)
    for prompt in ([1, 5, 9, 33, 7], list(range(3, 30))):
        params = SamplingParams(temperature=0.0, beam_width=width, n=width, max_tokens=12,
                                length_penalty=length_penalty, early_stopping=early_stopping)
        out = llm.generate([prompt], params)[0]
        expected = _hf_beams(hf, prompt, width, 12, length_penalty=length_penalty, early_stopping=early_stopping)
        assert [c.token_ids for c in out.outputs] == expected


def test_beams_share_prompt_blocks_and_copy_only_on_write(model_dir, make_llm):
    """At every step the prompt's full blocks exist once, referenced by every beam; the blocks
    in use are exactly the union of the beams' tables; each step copies at most one block per
    beam (copy-on-write), never a whole table."""
    path, _ = model_dir
    llm = make_llm(path, block_size=8, num_blocks=64)
    engine, width = llm.engine, 4
    prompt = list(range(3, 27))                                 # 3 full blocks
    engine.add_request("b", prompt, SamplingParams(temperature=0.0, beam_width=width, max_tokens=9,
                                                   ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        plan_copies = []
        original = engine.runner.copy_blocks
        engine.runner.copy_blocks = lambda copies: (plan_copies.extend(copies), original(copies))
        engine.step()
        engine.runner.copy_blocks = original
        steps += 1
        running = engine.scheduler.running
        if not running:
            break
        beams = running[0].unfinished()
        tables = [b.block_table for b in beams]
        in_use = {x for t in tables for x in t}
        assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == len(in_use)
        if steps > 1:
            assert len(beams) == width
            assert all(t[:3] == tables[0][:3] for t in tables)
            assert [engine.block_manager.blocks[x].ref_count for x in tables[0][:3]] == [width] * 3
        assert len(plan_copies) <= width
        engine.check_integrity()
    assert steps == 9                                           # the prefill samples token 1


def test_beam_width_below_n_is_refused():
    """n larger than the beam width is a clear ValueError."""
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(beam_width=2, n=3)
