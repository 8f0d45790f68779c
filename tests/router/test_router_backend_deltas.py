"""Both backends yield deltas (router/backend.py, issue #22): a choice's deltas add up to exactly
the engine's whole output, none repeats what an earlier one sent, none shows any part of a stop
string, and what a long choice keeps and yields does not grow with its length."""
from __future__ import annotations

import asyncio

import pytest

from pdwire.control import FirstToken, TokenDelta
from pdwire.sampling_params import SamplingParams
from router.colocated import ColocatedBackend
from tests.disagg_harness import END, Cluster, admit, run
from tests.router.test_router_colocated_engine import _engine_greedy, _engine_whole


def _deltas(engine, prompt: list[int], params: SamplingParams) -> list:
    """Every output a ColocatedBackend over `engine` yields for the request."""
    backend = ColocatedBackend(engine)

    async def collect():
        return [o async for o in backend.generate("r", prompt, params)]
    try:
        return asyncio.run(asyncio.wait_for(collect(), 20))
    finally:
        backend.close()


def _split_stop(engine, token_ids: list[int], text: str) -> str:
    """A 2-character stop string whose first character ends one token and whose second begins
    the next, at its first occurrence in `text`."""
    ends = [len(engine.tokenizer.decode(token_ids[:i + 1])) for i in range(len(token_ids))]
    cut = next(b for a, b, c in zip(ends, ends[1:], ends[2:]) if b > a and c > b and text.find(text[b - 1:b + 1]) == b - 1)
    return text[cut - 1:cut + 1]


def test_colocated_deltas_add_up_to_the_engine_output_with_n_logprobs_and_a_split_stop(real_engine):
    """n = 2 seeded samples with logprobs and a stop string split over two tokens: per choice, the
    deltas' text, tokens and logprobs joined are the engine's own output (stop string cut, never
    sent in part), and every token goes out the step it is made (only text is held)."""
    engine = real_engine
    prompt = engine.tokenizer.encode("hello world, the quick brown fox")
    base = SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=20, ignore_eos=True, logprobs=2)
    sample = _engine_whole(engine, prompt, base).outputs[0]
    stop = _split_stop(engine, sample.token_ids, sample.text)
    params = SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=20, ignore_eos=True, logprobs=2, stop=[stop])
    reference = _engine_whole(engine, prompt, params).outputs
    deltas = _deltas(engine, prompt, params)
    assert reference[0].finish_reason == "stop" and stop not in reference[0].text
    for ref in reference:
        mine = [c for o in deltas for c in o.outputs if c.index == ref.index]
        assert "".join(c.text for c in mine) == ref.text
        assert [t for c in mine for t in c.token_ids] == ref.token_ids
        assert [lp for c in mine for lp in c.logprobs] == ref.logprobs
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [ref.finish_reason]
        assert all(len(c.token_ids) == 1 for c in mine)     # one token a step, none held
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    engine.check_integrity()


def test_colocated_include_stop_str_in_output_keeps_the_stop_string(real_engine):
    """include_stop_str_in_output: the text ends with the stop string (split over two tokens),
    and the deltas, held back by nothing, add up to it."""
    engine = real_engine
    prompt = engine.tokenizer.encode("hello world, the quick brown fox")
    greedy = _engine_greedy(engine, prompt, 24)
    stop = _split_stop(engine, greedy.token_ids, greedy.text)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    deltas = _deltas(engine, prompt, params)
    text = "".join(c.text for o in deltas for c in o.outputs)
    assert text == greedy.text[:greedy.text.index(stop) + 2] and text.endswith(stop)
    assert deltas[-1].outputs[0].finish_reason == "stop"
    engine.check_integrity()


def test_colocated_beam_search_comes_once_whole_at_the_end(real_engine):
    """Beam search revises its beams until it ends: the backend yields them once, finished, equal
    to the engine's own beams."""
    engine = real_engine
    prompt = engine.tokenizer.encode("the quick brown fox")
    params = SamplingParams(n=2, beam_width=2, temperature=0, max_tokens=8, ignore_eos=True)
    reference = _engine_whole(engine, prompt, params).outputs
    deltas = _deltas(engine, prompt, params)
    assert len(deltas) == 1 and deltas[0].finished
    assert [(c.text, c.token_ids) for c in deltas[0].outputs] == [(c.text, c.token_ids) for c in reference]
    engine.check_integrity()


@pytest.mark.parametrize("pieces", [("hello <", "EN"), ("hello <E", "N")])
def test_disaggregated_never_sends_part_of_a_stop_string_split_over_deltas(pieces):
    """A decode node's stop string "<END>" arrives over three deltas, the last cutting the text
    back to where it began (as decode_node/streamer.py does): no delta the router yields holds
    any of it, and the text the client is sent adds up to what comes before it."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=8, stop=["<END>"])
            await admit(d, p)
            p.send(FirstToken("r1", 11, "h", None, ""))
            d.send(TokenDelta("r1", 0, (11, 20), 0, pieces[0], None, ""))
            d.send(TokenDelta("r1", 2, (21,), len(pieces[0]), pieces[1], None, ""))
            d.send(TokenDelta("r1", 3, (22,), 6, "", None, "stop"))
            while (final := await out.next()) is not END and not final.finished:
                pass
            assert final.outputs[0].text == "hello " and final.outputs[0].finish_reason == "stop"
            assert final.outputs[0].token_ids == [11, 20, 21, 22]
            assert all("<" not in o.text for delta in out.deltas for o in delta.outputs)
            assert "".join(o.text for delta in out.deltas for o in delta.outputs) == "hello "
    run(test)


def test_disaggregated_long_choice_keeps_and_yields_only_its_deltas():
    """400 one-token deltas of 5 characters each, stop string 8 long: each yielded delta is at
    most one delta's text plus the hold, and between yields the choice keeps at most the hold
    (7 characters) of its text, not the text so far."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=500, stop=["NEVERSAY"])
            await admit(d, p)
            choice = c.backend._requests["r1"].choices[0]
            p.send(FirstToken("r1", 11, "word ", None, ""))
            kept = []
            for i in range(1, 400):
                d.send(TokenDelta("r1", i, (11,), 5 * i, "word ", None, "length" if i == 399 else ""))
                await out.next()
                kept.append(len(choice.out.tail))
            assert max(kept) <= 7
            assert max(len(o.text) for delta in out.deltas for o in delta.outputs) <= 5 + 7
            assert max(len(o.token_ids) for delta in out.deltas for o in delta.outputs) <= 2
            assert "".join(o.text for delta in out.deltas for o in delta.outputs) == "word " * 400
    run(test)


def test_colocated_prompt_logprobs_come_once_with_the_first_choice_delta(real_engine):
    """prompt_logprobs with n = 2: the engine's prompt scores go exactly once, in the first output,
    beside choice deltas; no later output carries any."""
    engine = real_engine
    prompt = engine.tokenizer.encode("hello world, the quick brown fox")
    params = SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    reference = _engine_whole(engine, prompt, params)
    deltas = _deltas(engine, prompt, params)
    assert reference.prompt_logprobs is not None and len(reference.prompt_logprobs) == len(prompt)
    assert deltas[0].prompt_logprobs == reference.prompt_logprobs and deltas[0].outputs
    assert [o.prompt_logprobs for o in deltas[1:]] == [None] * (len(deltas) - 1)
    engine.check_integrity()
