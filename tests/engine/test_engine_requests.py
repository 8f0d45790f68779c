"""Engine behaviour per request: seeds, n > 1 sharing, stops, logprobs, aborts, bad input."""
from __future__ import annotations

import dataclasses

import pytest

from engine import SamplingParams


def test_seeded_sampling_is_reproducible(model_dir, make_llm):
    """The same seed gives the same sampled tokens across engines; another seed differs."""
    path, _ = model_dir
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    runs = [make_llm(path, num_blocks=32).generate([[1, 2, 3]], params)[0].outputs[0].token_ids
            for _ in range(2)]
    other = make_llm(path, num_blocks=32).generate(
        [[1, 2, 3]], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True))
    assert runs[0] == runs[1]
    assert other[0].outputs[0].token_ids != runs[0]


def test_prior_outputs_continue_a_seeded_penalized_request(model_dir, make_llm):
    """A request restarted from prompt + its first k tokens with prior_outputs=k (as the router
    does after a node is lost) samples the same remaining tokens: the k tokens count for the
    presence / frequency penalties and the seeded draws. n > 1 choices are seeded seed + i."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=32)
    params = SamplingParams(temperature=1.0, top_k=30, seed=5, max_tokens=12, ignore_eos=True,
                            presence_penalty=2.0, frequency_penalty=1.0, n=2)
    prompt = [4, 8, 15, 16, 23, 42]
    whole = llm.generate([prompt], params)[0].outputs
    rest = dataclasses.replace(params, max_tokens=7, n=1)
    llm.engine.add_request("moved", prompt + whole[0].token_ids[:5], rest, prior_outputs=5)
    llm.engine.add_request("fresh", prompt + whole[0].token_ids[:5], rest)
    second = dataclasses.replace(params, seed=6, max_tokens=12, n=1)
    llm.engine.add_request("second", prompt, second)
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in llm.engine.step() if o.finished)
    assert outs["moved"] == whole[0].token_ids[5:]
    assert outs["fresh"] != whole[0].token_ids[5:]
    assert outs["second"] == whole[1].token_ids
    for bad in (-1, 11, 12, 2.0):
        with pytest.raises(ValueError, match="prior_outputs"):
            llm.engine.add_request("bad", prompt + whole[0].token_ids[:5], rest, prior_outputs=bad)
    with pytest.raises(ValueError, match="single completion"):
        llm.engine.add_request("bad", prompt, params, prior_outputs=1)


def test_n4_shares_one_physical_copy_of_the_prompt(model_dir, make_llm):
    """n = 4 completions hold one copy of the prompt's blocks, each block referenced 4 times."""
    path, _ = model_dir
    llm = make_llm(path, block_size=8, num_blocks=64)
    prompt = list(range(3, 35))                       # exactly 4 full blocks
    llm.engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8,
                                                       ignore_eos=True))
    llm.engine.step()                                 # prefill + first token, then fork
    group = llm.engine.scheduler.running[0]
    tables = [s.block_table for s in group.seqs]
    assert len(group.seqs) == 4
    assert all(t[:4] == tables[0][:4] for t in tables)
    assert [llm.engine.block_manager.blocks[b].ref_count for b in tables[0][:4]] == [4, 4, 4, 4]
    llm.engine.check_integrity()
    while llm.engine.has_unfinished_requests():
        outs = llm.engine.step()
    assert len(outs[0].outputs) == 4 and all(len(o.token_ids) == 8 for o in outs[0].outputs)
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1


def test_stop_token_and_max_tokens(model_dir, make_llm):
    """A stop token id ends the completion with reason stop; otherwise max_tokens gives length."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                        stop_token_ids=[tokens[3]]))[0].outputs[0]
    first = tokens.index(tokens[3])
    assert stopped.token_ids == tokens[: first + 1] and stopped.finish_reason == "stop"
    assert llm.generate([[5, 6, 7]], greedy)[0].outputs[0].finish_reason == "length"


def test_logprobs_hold_top_n_and_the_chosen_token(model_dir, make_llm):
    """logprobs=3 returns, per token, the 3 most likely tokens plus the chosen one, all <= 0."""
    path, _ = model_dir
    out = make_llm(path, num_blocks=32).generate(
        [[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert max(entry, key=entry.get) == token      # greedy picks the most likely
        assert all(v <= 0 for v in entry.values())


def test_penalties_change_greedy_output(model_dir, make_llm):
    """A strong repetition penalty steers greedy decoding away from repeated tokens."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=32)
    plain = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    penal = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                     frequency_penalty=2.0, presence_penalty=2.0))
    plain_ids, penal_ids = plain[0].outputs[0].token_ids, penal[0].outputs[0].token_ids
    assert len(set(penal_ids)) > len(set(plain_ids))


@pytest.mark.parametrize("prompt,message", [([], "empty"), ([7] * 600, "context"),
                                            ([1, 2, 10_000], "token ids"), ("text", "tokenizer"),
                                            ([1.5], "prompt must be")])
def test_bad_prompt_is_refused_and_others_keep_running(model_dir, make_llm, prompt, message):
    """A bad prompt raises a clear ValueError and a request already queued still completes."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=64)
    llm.engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, SamplingParams())
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert outs[-1].request_id == "good" and len(outs[-1].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(n=0),
                                    dict(max_tokens=0), dict(logprobs=50), dict(min_p=2.0),
                                    dict(temperature=float("inf")), dict(repetition_penalty=float("nan")),
                                    dict(top_p=True), dict(seed=2 ** 64), dict(top_k=2 ** 63),
                                    dict(min_tokens=5, max_tokens=4)])
def test_unknown_sampling_values_raise(kwargs):
    """Out-of-range sampling values raise ValueError naming the field."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_extreme_but_valid_values_sample_and_bad_stop_ids_are_refused(model_dir, make_llm):
    """Values that once crashed the engine loop: a near-zero repetition penalty (inf logits), a
    top_k past the vocabulary, a seed at the int64 edge with n = 2 (seed + 1 wraps). All sample;
    a stop token id outside the vocabulary is refused up front, and the engine keeps serving."""
    path, _ = model_dir
    llm = make_llm(path, num_blocks=32)
    many = [SamplingParams(temperature=1.0, repetition_penalty=1e-300, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=2 ** 62, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=2 ** 63 - 1, n=2, max_tokens=4, ignore_eos=True)]
    outs = llm.generate([[5, 6, 7]] * 3, many)
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[4], [4], [4, 4]]
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request("bad", [5, 6, 7], SamplingParams(stop_token_ids=(99999,)))
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2


def test_a_tiny_vocabulary_takes_any_logprobs_and_refuses_a_ban_on_every_token(tmp_path, make_llm):
    """A 16-token vocabulary: logprobs=20 returns all 16 (it crashed the step, failing the
    requests batched with it); min_tokens with every token a stop token is refused up front."""
    from tests.model_factory import make_model
    make_model(tmp_path, "llama", vocab=16)
    llm = make_llm(str(tmp_path), num_blocks=32)
    outs = llm.generate([[3, 4, 5]] * 2, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, logprobs=20)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert all(len(entry) == 16 for entry in outs[1].outputs[0].logprobs)
    with pytest.raises(ValueError, match="bans every token"):
        llm.engine.add_request("ban", [3, 4, 5], SamplingParams(min_tokens=3, stop_token_ids=tuple(range(16))))


@pytest.mark.parametrize("budget", [2048, 7, "capped"])
def test_prompt_logprobs_equal_transformers(model_dir, make_llm, budget, monkeypatch):
    """prompt_logprobs: per prompt token (the first has none) its logprob under transformers'
    forward pass and the top-3, whole, in 7-token chunks, or in chunks of PROMPT_LOGPROBS_CHUNK
    (here 5) even with chunked prefill off; computed even when the prompt's blocks sit in the
    prefix cache (a cache hit has no logits)."""
    import torch

    from engine import scheduler
    chunked = budget != "capped"
    if not chunked:
        monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK", 5)
        budget = 2048
    path, hf = model_dir
    prompt = [(i * 37) % 500 + 3 for i in range(29)]
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    llm = make_llm(path, block_size=8, num_blocks=64, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    plain = llm.generate([prompt], greedy)[0]
    assert plain.prompt_logprobs is None
    out = llm.generate([prompt], dataclasses.replace(greedy, prompt_logprobs=3))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    logprobs = out.prompt_logprobs
    assert len(logprobs) == len(prompt) and logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(logprobs[i][prompt[i]] - expected[i - 1, prompt[i]].item()) < 1e-4
        top3 = expected[i - 1].topk(3).indices.tolist()
        assert set(top3) <= set(logprobs[i]) and len(logprobs[i]) <= 4


def test_abort_frees_blocks_at_once(model_dir, make_llm):
    """Aborting a running request frees every block it held and reports reason abort."""
    path, _ = model_dir
    llm = make_llm(path, block_size=8, num_blocks=32)
    llm.engine.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.block_manager.num_free_blocks < 32
    llm.engine.abort_request("a")
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("saved,device,expected", [("float16", "cpu", "bfloat16"), ("float16", "cuda", "float16"),
                                                   ("bfloat16", "cpu", "bfloat16"), ("float32", "cpu", "float32")])
def test_auto_dtype_is_the_saved_one_but_float16_runs_in_bfloat16_on_cpu(tmp_path, saved, device, expected):
    """dtype "auto" keeps the checkpoint's dtype, except float16 on CPU (as vLLM's CPU backend)."""
    import json
    import torch
    from engine import ModelConfig
    from tests.model_factory import make_model
    make_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = saved
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(str(tmp_path), "auto", device_type=device).dtype == getattr(torch, expected)
    assert ModelConfig.from_pretrained(str(tmp_path), "float16", device_type="cpu").dtype == torch.float16
