"""DisaggregatedBackend against scripted node peers (tests/disagg_harness.py) when things go wrong:
node deaths and migration, client aborts (the control plane's checks: test_router_control_plane.py)."""
from __future__ import annotations

import asyncio

import pytest

from pdwire.sampling_params import SamplingParams
from pdwire.control import AbortRequest, DecodeRequest, FirstToken, PrefillRequest, RequestFailed, TokenDelta
from pdwire.messages import Reserved
from router.cluster.registry import NodeRole
from tests.disagg_harness import LOSSY, PROMPT, END, Consumer, Cluster, run, until, first_of, view, counter, admit


@pytest.mark.parametrize("death", ["heartbeat", "new_epoch"])
def test_decode_death_mid_stream_migrates_without_losing_or_repeating_tokens(death):
    """D dies after 3 tokens: a new request with prompt + those tokens and max/min_tokens less 3
    runs on the other D, and the client's stream continues exactly where it was."""
    async def test():
        async with Cluster(LOSSY) as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=8, min_tokens=4, prompt_logprobs=0)
            dead, _ = await first_of(ds, DecodeRequest)
            dead.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            seen = []
            for sender, msg in ((p, FirstToken("r1", 11, "a", None, "")),
                                (dead, TokenDelta("r1", 0, (11, 12), 0, "ab", None, "")),
                                (dead, TokenDelta("r1", 2, (13,), 2, "c", None, ""))):
                sender.send(msg)
                seen.append(view(await out.next()))
            assert seen[-1] == ([([11, 12, 13], "abc", None)], False)
            if death == "heartbeat":
                dead.die()
            else:
                await dead.hello(epoch="e2")
            live = ds[1 - ds.index(dead)]
            req = await live.expect(DecodeRequest, timeout=5.0)
            assert (req.rid, list(req.prompt_ids)) == ("r1~1", PROMPT + [11, 12, 13])
            assert (req.params.max_tokens, req.params.min_tokens, req.prior_outputs) == (5, 1, 3)
            assert req.params.prompt_logprobs is None       # the prompt was scored before the move
            assert (await p.expect(AbortRequest)).rid == "r1"   # it may still be shipping to the dead D
            live.send(Reserved("r1~1", "x2", (7, 8), 0))
            pre = await p.expect(PrefillRequest)
            assert (pre.rid, pre.kv_endpoint, pre.prior_outputs) == ("r1~1", live.kv_endpoint, 3)
            p.send(FirstToken("r1~1", 14, "d", None, ""))
            live.send(TokenDelta("r1~1", 0, (14, 15), 0, "de", None, ""))
            live.send(TokenDelta("r1~1", 2, (16,), 2, "f", None, "stop"))
            while (final := await out.next()) is not END and not final.finished:
                seen.append(view(final))
            seen.append(view(final))
            assert seen[-1] == ([([11, 12, 13, 14, 15, 16], "abcdef", "stop")], True)
            for (before, _), (after, _) in zip(seen, seen[1:]):      # each output extends the last
                assert after[0][0][:len(before[0][0])] == before[0][0]
                assert after[0][1].startswith(before[0][1])
            assert counter(c.backend.collectors()[1]) == 1      # migrations
            if death == "new_epoch":    # the restarted node is told to drop the old attempt
                assert (await dead.expect(AbortRequest)).rid == "r1"
    run(test)


@pytest.mark.parametrize("finish, include", [("", False), ("length", False), ("", True)])
def test_stop_string_split_by_a_migration_is_found_by_the_router(finish, include):
    """Stop "cd": the lost D sent "abc", the new attempt's first token "de" completes it. The new
    node never saw the "c", so the router cuts the text at "ab" (after "cd" with
    include_stop_str_in_output) and finishes with "stop" (also when that token was the last one
    allowed), aborting the new attempt if it runs on; the client never saw the held-back "c"."""
    async def test():
        async with Cluster(LOSSY) as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=8, stop=["cd"], include_stop_str_in_output=include)
            dead, _ = await first_of(ds, DecodeRequest)
            dead.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, ""))
            dead.send(TokenDelta("r1", 0, (11, 12, 13), 0, "abc", None, ""))
            seen = [view(await out.next())]
            dead.die()
            live = ds[1 - ds.index(dead)]
            await live.expect(DecodeRequest, timeout=5.0)
            assert (await p.expect(AbortRequest)).rid == "r1"
            live.send(Reserved("r1~1", "x2", (7, 8), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1~1", 14, "de", None, finish))
            while (final := await out.next()) is not END and not final.finished:
                seen.append(view(final))
            assert view(final) == ([([11, 12, 13, 14], "abcd" if include else "ab", "stop")], True)
            assert "".join(o.text for delta in out.deltas for o in delta.outputs) == final.outputs[0].text
            if not finish:
                assert (await live.expect(AbortRequest)).rid == "r1~1"
    run(test)


def test_decode_death_after_the_last_token_finishes_with_length():
    """D lost after sending all max_tokens tokens but no finish: the choice ends 'length', unmigrated."""
    async def test():
        async with Cluster(LOSSY) as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=2)
            await admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, ""))
            assert view(await out.next()) == ([([11, 12], "ab", None)], False)
            d.die()
            assert view(await out.next(timeout=5.0)) == ([([11, 12], "ab", "length")], True)
            assert counter(c.backend.collectors()[1]) == 0      # nothing was left to migrate
    run(test)


def test_prefill_death_after_first_token_changes_nothing():
    """P lost after its FirstToken: D goes on and the request completes on the same attempt."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=2)
            await admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            await out.next()
            p.die()
            await until(lambda: not c.backend.server.count(NodeRole.PREFILL))
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            await d.assert_silent()
    run(test)


def test_a_prefill_nodes_failure_after_its_first_token_aborts_the_decode_node_and_migrates():
    """P's first token is in, then its transfer to D breaks (here its Commit's send timed out) and
    P reports RequestFailed: D is aborted at once (it would hold the reservation until its lease),
    and the request runs again from prompt + the token streamed, its stream going on exactly
    where it was; one migration, counted for node_failure."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=4)
            await admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            p.send(RequestFailed("r1", "transfer failed: its Commit was not sent: not draining", True))
            assert (await d.expect(AbortRequest)).rid == "r1"
            req = await d.expect(DecodeRequest)
            assert (req.rid, list(req.prompt_ids), req.params.max_tokens, req.prior_outputs) == \
                ("r1~1", PROMPT + [11], 3, 1)
            d.send(Reserved("r1~1", "x2", (5, 6), 0))
            assert (await p.expect(AbortRequest)).rid == "r1"
            assert (await p.expect(PrefillRequest)).rid == "r1~1"
            p.send(FirstToken("r1~1", 12, "b", None, ""))
            d.send(TokenDelta("r1~1", 0, (12, 13, 14), 0, "bcd", None, "length"))
            while (final := await out.next()) is not END and not final.finished:
                pass
            assert view(final) == ([([11, 12, 13, 14], "abcd", "length")], True)
            assert counter(c.backend.collectors()[1], {"cause": "node_failure", "how": "reprefill"}) == 1
    run(test)


# ------------------------------------------------------------------ aborts


@pytest.mark.parametrize("how", ["aclose", "abort", "cancel"])
def test_client_abort_reaches_both_nodes(how):
    """Closing the stream, abort(rid) or cancelling the consumer sends AbortRequest to P and D."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            stream = c.backend.generate("r1", PROMPT, SamplingParams(max_tokens=8))
            out = Consumer(stream)
            await admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            if how == "abort":
                await c.backend.abort("r1")
                assert await out.next() is END         # stops without a finished output
            elif how == "cancel":
                out.task.cancel()
            else:
                out.task.cancel()
                await asyncio.gather(out.task, return_exceptions=True)
                await stream.aclose()
            assert (await p.expect(AbortRequest)).rid == "r1"
            assert (await d.expect(AbortRequest)).rid == "r1"
            assert [n.inflight_requests for n in c.backend.server.registry.nodes()] == [0, 0]
    run(test)


def test_request_id_is_free_again_after_abort():
    """After abort(rid) the id may be reused at once, and the old stream's cleanup leaves the new one be."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            old = c.generate()
            await d.expect(DecodeRequest)
            await c.backend.abort("r1")
            await d.expect(AbortRequest)
            new = c.generate(max_tokens=1)
            assert await old.next() is END
            await admit(d, p)
            p.send(FirstToken("r1", 4, "x", None, "length"))
            assert view(await new.next()) == ([([4], "x", "length")], True)
    run(test)


def test_abort_before_reservation_reaches_only_decode_node():
    """An abort while D has not answered: D gets AbortRequest; P, never asked, gets nothing."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate()
            await d.expect(DecodeRequest)
            await c.backend.abort("r1")
            assert (await d.expect(AbortRequest)).rid == "r1"
            d.send(Reserved("r1", "x1", (3, 4), 0))     # too late: dropped as stray
            await p.assert_silent()
            assert await out.next() is END
    run(test)
