"""--long-prefill-token-threshold: a prompt computes at most that many tokens a step, so a short
prompt scheduled beside a long one waits for a short chunk of it; the tokens stay transformers'."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.args import EngineArgs
from engine.config import SchedulerConfig
from tests.model_factory import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = [(i * 37) % 500 + 3 for i in range(53)]
SHORT = [1, 17, 99, 4, 250]


def _record_steps(llm) -> list[dict[str, int]]:
    """Each step's scheduled prompt tokens by request id (the scheduler's output, as it runs)."""
    steps: list[dict[str, int]] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append({s.group.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("threshold", [0, 16])
def test_a_short_prompt_beside_a_long_one_waits_for_one_capped_chunk(model_dir, make_llm, threshold):
    """A long prompt and a short one arriving together share the first step. Capped at 16 tokens
    a step, the long prompt takes ceil(53 / 16) = 4 steps and the first holds 16 + 5 tokens; uncapped
    it is one 58-token step. Either way both decode transformers' tokens."""
    path, hf = model_dir
    llm = make_llm(path, block_size=8, num_blocks=64, long_prefill_token_threshold=threshold)
    steps = _record_steps(llm)
    outs = llm.generate([LONG, SHORT], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in (LONG, SHORT)]
    long_id, short_id = outs[0].request_id, outs[1].request_id
    long_chunks = [s[long_id] for s in steps if s.get(long_id, 0) > 1]
    if threshold:
        assert steps[0] == {long_id: 16, short_id: 5}
        assert long_chunks == [16, 16, 16, 5]
        assert max(n for s in steps for n in s.values()) <= threshold
    else:
        assert steps[0] == {long_id: 53, short_id: 5}
        assert long_chunks == [53]


def test_capped_chunks_under_a_small_budget_match_transformers(model_dir, make_llm):
    """The cap and a step budget smaller than it together, three prompts of 5-53 tokens: every
    chunk is within both, and the output is token for token transformers'."""
    path, hf = model_dir
    llm = make_llm(path, block_size=8, num_blocks=64, max_num_batched_tokens=11, long_prefill_token_threshold=7)
    steps = _record_steps(llm)
    prompts = [SHORT, list(range(10, 26)), LONG]
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert max(n for s in steps for n in s.values()) == 7
    assert max(sum(s.values()) for s in steps) <= 11


def test_the_cap_is_checked_and_reaches_the_scheduler():
    """A negative cap, or one without chunked prefill (whose prompts are one step each), is refused;
    EngineArgs (every CLI's flags) hands it to the scheduler."""
    with pytest.raises(ValueError, match=">= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=256)
    config = EngineArgs(long_prefill_token_threshold=256).engine_config()
    assert config.scheduler.long_prefill_token_threshold == 256
