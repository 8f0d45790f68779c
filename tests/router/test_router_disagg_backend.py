"""DisaggregatedBackend against scripted node peers (tests/disagg_harness.py): the request flow,
n > 1, Busy decode nodes, retries and rejections; Busy replies counted by the role of their node
(the autoscaler's decode signal reads the decode nodes' only)."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdwire.control import (AbortRequest, DecodeRequest, FirstToken, PrefillRequest, RequestFailed,
                                 TokenDelta)
from pdwire.messages import Busy, Reserved
from pdplan.signals import MetricsWindow
from router.backend import NoNodeAvailable
from router.http.metrics import RouterMetrics
from tests.disagg_harness import PROMPT, CONFIG, END, Cluster, run, first_of, view, counter, admit, until


# ------------------------------------------------------------------ happy path


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_first_token_then_deltas_give_exact_cumulative_outputs(loop):
    """P's first token is emitted before D sends anything; D's re-sent token 0 is not emitted twice
    (the deltas summed are exactly the whole output)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=4, logprobs=1)
            req = await d.expect(DecodeRequest)
            assert (req.rid, list(req.prompt_ids), req.prefill_node_id) == ("r1", PROMPT, "prefill-0")
            assert (req.params.n, req.params.max_tokens, req.params.logprobs) == (1, 4, 1)
            d.send(Reserved("r1", "x1", (3, 4), 1))
            pre = await p.expect(PrefillRequest)
            assert (pre.rid, list(pre.prompt_ids), pre.kv_endpoint) == ("r1", PROMPT, d.kv_endpoint)
            assert (pre.xfer_id, pre.dst_block_ids, pre.cached_prefix_blocks) == ("x1", (3, 4), 1)
            p.send(FirstToken("r1", 11, "a", [[11, -0.1], [12, -2.0]], ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", ([[12, -0.2]],), ""))
            assert view(await out.next()) == ([([11, 12], "ab", None)], False)
            d.send(TokenDelta("r1", 2, (13, 14), 2, "cd", ([[13, -0.3]], [[14, -0.4]]), "length"))
            final = await out.next()
            assert view(final) == ([([11, 12, 13, 14], "abcd", "length")], True)
            assert final.outputs[0].logprobs == [{11: -0.1, 12: -2.0}, {12: -0.2}, {13: -0.3}, {14: -0.4}]
            assert final.prompt_token_ids == PROMPT
            assert await out.next() is END
            await p.assert_silent(), await d.assert_silent()    # a finished request is not aborted
            assert [(n.inflight_requests, n.inflight_blocks) for n in c.backend.server.registry.nodes()] \
                == [(0, 0), (0, 0)]
    run(test, loop)


def test_a_stop_string_cut_reaches_text_already_merged():
    """D's last delta says the text now ends earlier (a stop string cut what it completes, part
    of it sent before): the router cuts its text there too."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=8, stop=["b c"])
            await d.expect(DecodeRequest)
            d.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, ""))
            d.send(TokenDelta("r1", 0, (11, 12), 0, "a b", None, ""))
            d.send(TokenDelta("r1", 2, (13,), 1, "", None, "stop"))
            while (final := await out.next()) is not END and not final.finished:
                pass
            assert view(final) == ([([11, 12, 13], "a", "stop")], True)
    run(test)


def test_prompt_logprobs_from_the_prefill_node_reach_the_output():
    """P's first token carries the prompt's logprobs: the request's outputs have them (one entry
    per prompt token, the first None). Scores that do not fit the prompt (an entry too many, or
    an entry without its own token's score) are ignored."""
    good = [None] + [[[t, -0.5]] for t in PROMPT[1:]]

    async def test():
        for scores in (good, good + [[[1, -0.1]]], good[:2] + [[[1, -0.1]]] + good[3:]):
            async with Cluster() as c:
                p, d = await c.pair()
                out = c.generate(max_tokens=2, prompt_logprobs=1)
                await d.expect(DecodeRequest)
                d.send(Reserved("r1", "x1", (3, 4), 0))
                assert (await p.expect(PrefillRequest)).params.prompt_logprobs == 1
                p.send(FirstToken("r1", 11, "a", None, "", scores))
                d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
                while (final := await out.next()) is not END and not final.finished:
                    pass
                expected = [None] + [{t: -0.5} for t in PROMPT[1:]] if scores is good else None
                assert final.prompt_logprobs == expected
    run(test)


def test_only_the_first_choice_asks_for_prompt_logprobs():
    """n = 2: choice 0's prefill scores the prompt, choice 1's does not; the request's outputs
    carry the scores from choice 0's first token, whichever first token comes first: choice 1's
    token waits for them (an echoed stream sends the prompt's scores before any choice)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=1, prompt_logprobs=0, n=2, temperature=1.0, seed=1)
            asked = {}
            for _ in range(2):
                req = await d.expect(DecodeRequest)
                d.send(Reserved(req.rid, "x" + req.rid[-1], (3, 4), 0))
                pre = await p.expect(PrefillRequest)
                asked[pre.rid] = pre.params.prompt_logprobs
            assert asked == {"r1#0": 0, "r1#1": None}
            p.send(FirstToken("r1#1", 12, "b", None, "length"))
            p.send(FirstToken("r1#0", 11, "a", None, "length", [None] + [[[t, -0.5]] for t in PROMPT[1:]]))
            while (final := await out.next()) is not END and not final.finished:
                pass
            assert final.prompt_logprobs == [None] + [{t: -0.5} for t in PROMPT[1:]]
            assert out.deltas[0].prompt_logprobs == final.prompt_logprobs   # before or with any choice
            assert sorted(d.index for o in out.deltas for d in o.outputs) == [0, 1]
    run(test)


def test_a_final_delta_cannot_take_back_text_beyond_a_stop_string():
    """A final delta that would shrink the text more than a stop string can reach (or with no
    stop string at all) takes back only what the router held back from the client."""
    async def test():
        for stop, finish, expected in (((), "length", "hello world"), (("xy",), "stop", "hello worl")):
            async with Cluster() as c:
                p, d = await c.pair()
                out = c.generate(max_tokens=8, stop=list(stop))
                await d.expect(DecodeRequest)
                d.send(Reserved("r1", "x1", (3, 4), 0))
                await p.expect(PrefillRequest)
                p.send(FirstToken("r1", 11, "hello", None, ""))
                d.send(TokenDelta("r1", 0, (11, 12), 0, "hello world", None, ""))
                d.send(TokenDelta("r1", 2, (13,), 0, "", None, finish))
                while (final := await out.next()) is not END and not final.finished:
                    pass
                assert view(final) == ([([11, 12, 13], expected, finish)], True)
    run(test)


def test_decode_delta_before_first_token_is_held_until_it():
    """A delta from D that overtakes P's FirstToken waits for it; every token is emitted once, in order."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=3)
            await admit(d, p)
            d.send(TokenDelta("r1", 1, (12,), 1, "b", None, ""))
            d.send(TokenDelta("r1", 0, (11, 12, 13), 0, "abc", None, "stop"))
            await until(lambda: len(c.backend._attempts["r1"].held) == 2)     # both reached the router
            assert out.items.empty()
            p.send(FirstToken("r1", 11, "a", None, ""))
            final = await out.next()
            assert view(final) == ([([11, 12, 13], "abc", "stop")], True)
    run(test)


def test_first_token_that_finishes_aborts_the_decode_reservation():
    """A request finished by P's first token frees D's reserved blocks (AbortRequest to D)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=1)
            await admit(d, p)
            p.send(FirstToken("r1", 2, "", None, "stop"))
            assert view(await out.next()) == ([([2], "", "stop")], True)
            assert (await d.expect(AbortRequest)).rid == "r1"
    run(test)


def test_n_fans_out_with_seeds_and_merges_by_index():
    """n = 2 runs rid#0 and rid#1 with seed and seed + 1, merged as outputs 0 and 1."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(n=2, seed=7, temperature=1.0, max_tokens=1)
            reqs = {}
            for _ in range(2):
                req = await d.expect(DecodeRequest)
                reqs[req.rid] = req
                d.send(Reserved(req.rid, f"x{len(reqs)}", (3, 4), 0))
            assert {rid: (r.params.n, r.params.seed) for rid, r in reqs.items()} == \
                {"r1#0": (1, 7), "r1#1": (1, 8)}
            for _ in range(2):
                pre = await p.expect(PrefillRequest)
                p.send(FirstToken(pre.rid, 20 + int(pre.rid[-1]), pre.rid[-1], None, "length"))
            while not (final := await out.next()).finished:
                assert len([o for o in final.outputs if o.finish_reason]) < 2
            assert view(final) == ([([20], "0", "length"), ([21], "1", "length")], True)
    run(test)


# ------------------------------------------------------------------ backpressure


def test_busy_decode_node_is_skipped_for_another():
    """Busy from one D sends the request to the other D at once, without waiting retry_after_ms;
    it is counted as a decode node's, the autoscaler's signal to grow the decode pool."""
    async def test():
        async with Cluster() as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            window = MetricsWindow(RouterMetrics(c.backend).registry, 60.0, lambda: 0.0)
            window.sample()
            out = c.generate(max_tokens=1)
            busy_d, req = await first_of(ds, DecodeRequest)
            busy_d.send(Busy("r1", "no free blocks", 60_000))
            other = ds[1 - ds.index(busy_d)]
            req2 = await other.expect(DecodeRequest, timeout=1.0)
            assert (req2.rid, req2.prompt_ids) == (req.rid, req.prompt_ids)
            other.send(Reserved("r1", "x1", (3, 4), 0))
            assert (await p.expect(PrefillRequest)).kv_endpoint == other.kv_endpoint
            p.send(FirstToken("r1", 9, "z", None, "length"))
            assert view(await out.next()) == ([([9], "z", "length")], True)
            assert _busy(c) == {"decode": 1, "prefill": 0}
            window.sample()
            assert window.busy() == 1
            await busy_d.assert_silent()    # Busy held nothing: nothing to abort there
    run(test)


def test_all_busy_waits_retry_after_then_times_out():
    """With every D busy the router asks again after retry_after_ms (200 ms), not sooner; past the
    admission deadline (3 s: room for two asks on a starved machine): 503."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, admission_timeout_s=3.0)) as c:
            await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            loop = asyncio.get_running_loop()
            out = c.generate()
            asked = []

            async def busy() -> None:       # every ask answered Busy, until the router gives up
                while True:
                    ask = await d.expect(DecodeRequest, timeout=60.0)
                    asked.append(loop.time())
                    d.send(Busy(ask.rid, "full", 200))
            answering = asyncio.create_task(busy())
            err = await out.next(timeout=60.0)
            answering.cancel()
            assert isinstance(err, NoNodeAvailable)
            assert len(asked) >= 2 and min(b - a for a, b in zip(asked, asked[1:])) >= 0.19
    run(test)


# ------------------------------------------------------------------ failures


def test_prefill_failure_before_first_token_retries_on_another_prefill_node():
    """RequestFailed from P before its first token: D's reservation is aborted and the request reruns
    on the other P, under a new wire rid, with nothing emitted twice."""
    async def test():
        async with Cluster() as c:
            ps = [await c.node("prefill-0", "prefill"), await c.node("prefill-1", "prefill")]
            d = await c.node("decode-0", "decode")
            out = c.generate(max_tokens=2)
            await d.expect(DecodeRequest)
            d.send(Reserved("r1", "x1", (3, 4), 0))
            bad_p, _ = await first_of(ps, PrefillRequest)
            bad_p.send(RequestFailed("r1", "transfer refused", True))
            assert (await d.expect(AbortRequest)).rid == "r1"
            assert (await bad_p.expect(AbortRequest)).rid == "r1"
            req = await d.expect(DecodeRequest)
            good_p = ps[1 - ps.index(bad_p)]
            assert (req.rid, req.prefill_node_id, list(req.prompt_ids)) == ("r1~1", good_p.node_id, PROMPT)
            d.send(Reserved("r1~1", "x2", (5, 6), 0))
            assert (await good_p.expect(PrefillRequest)).xfer_id == "x2"
            good_p.send(FirstToken("r1~1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1~1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            assert counter(c.backend.collectors()[0]) == 1      # retries
    run(test)


def test_retries_are_bounded():
    """With max_retries = 1 a request whose prefill fails twice raises RuntimeError after 2 attempts."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=1)) as c:
            p, d = await c.pair()
            out = c.generate()
            for rid in ("r1", "r1~1"):
                await d.expect(DecodeRequest)
                d.send(Reserved(rid, "x1", (3, 4), 0))
                await p.expect(PrefillRequest)
                p.send(RequestFailed(rid, "out of memory", True))
                assert (await d.expect(AbortRequest)).rid == rid
                assert (await p.expect(AbortRequest)).rid == rid
            err = await out.next()
            assert isinstance(err, RuntimeError) and "after 2 attempts" in str(err)
            await d.assert_silent()
    run(test)


def test_a_prefill_nodes_busy_grammar_compiler_after_the_reservation_is_asked_again():
    """P answers its PrefillRequest Busy (its grammar compiler has too many compiles): D's
    reservation is aborted, and once P's retry hint has passed the request runs again on P (the
    only prefill node), using none of its max_retries (a retry loop would end in a 500), counted
    as a retry for "busy" and as a prefill node's Busy reply (not the decode pool's signal); no
    503 before the admission timeout."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=0)) as c:
            p, d = await c.pair()
            window = MetricsWindow(RouterMetrics(c.backend).registry, 60.0, lambda: 0.0)
            window.sample()
            out = c.generate(max_tokens=1)
            await admit(d, p)
            p.send(Busy("r1", "18 grammars are compiling or queued on this node", 50))
            assert (await d.expect(AbortRequest)).rid == "r1"
            assert (await d.expect(DecodeRequest)).rid == "r1~1"
            d.send(Reserved("r1~1", "x2", (3, 4), 0))
            assert (await p.expect(AbortRequest)).rid == "r1"
            assert (await p.expect(PrefillRequest)).rid == "r1~1"
            p.send(FirstToken("r1~1", 11, "a", None, "length"))
            assert view(await out.next()) == ([([11], "a", "length")], True)
            assert counter(c.backend.collectors()[0], {"cause": "busy"}) == 1
            assert _busy(c) == {"decode": 0, "prefill": 1}      # a prefill node's Busy was not counted
            window.sample()
            assert window.busy() == 0       # a busy grammar compiler is no sign the decode pool is short
    run(test)


def test_non_retryable_failure_before_any_token_is_a_rejection():
    """A node's non-retryable RequestFailed before any output raises ValueError (HTTP 400)."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            out = c.generate()
            await d.expect(DecodeRequest)
            d.send(RequestFailed("r1", "prompt needs more blocks than the pool has", False))
            err = await out.next()
            assert isinstance(err, ValueError) and "more blocks" in str(err)
    run(test)


@pytest.mark.parametrize("cached_blocks, cached_tokens", [(0, 0), (1, 4), (2, 5)])
def test_cached_tokens_come_from_the_decode_reservation(cached_blocks, cached_tokens):
    """num_cached_tokens: D's cached prefix blocks x block size, at most the prompt's length - 1."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=1)
            await d.expect(DecodeRequest)
            d.send(Reserved("r1", "x1", (3, 4), cached_blocks))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, "length"))
            final = await out.next()
            assert final.finished and final.num_cached_tokens == cached_tokens
    run(test)


def _busy(c: Cluster) -> dict[str, float]:
    """pdserve_router_busy_replies_total by role."""
    return {role: counter(c.backend.collectors()[2], {"role": role}) for role in ("decode", "prefill")}
