"""A structured output's grammar compiles on its prefill and decode node at once, before the decode
node reserves KV blocks (router/cluster/grammar_first.py), against scripted nodes: no reservation
waits on a compile, and each node's answer keeps its meaning (Busy, 503, 400)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pdwire.control import AbortRequest, CompileGrammar, DecodeRequest, FirstToken, PrefillRequest, RequestFailed
from pdwire.control import GrammarReady, TokenDelta
from pdwire.messages import Busy, Reserved
from pdwire.structured_output import GrammarKind, StructuredOutput
from pdwire.sampling_params import SamplingParams
from pdwire.schema import MAX_RID_LEN
from router.backend import NoNodeAvailable
from router.cluster.admission import Admission, _Rounds
from router.cluster.busy_prefills import BusyPrefills
from router.cluster.disagg_request import Attempt, Choice
from router.config import ADMISSION_FIRST_WAIT_S
from tests.disagg_harness import CONFIG, END, Cluster, first_of, run, view

REGEX = StructuredOutput(GrammarKind.REGEX, "[ab]{2}")


async def _compiles(*nodes) -> None:
    """Each node is asked to compile r1's grammar, and nothing else yet."""
    for node in nodes:
        msg = await node.expect(CompileGrammar)
        assert (msg.rid, msg.params.structured) == ("r1", REGEX)


def test_both_nodes_compile_at_once_and_the_decode_node_reserves_only_after_both():
    """CompileGrammar goes to P and D together (their compiles overlap: one compile's time before
    the first token, not two in a row); D gets its DecodeRequest only once P's compile is done too
    (D's reservation used to be held while P compiled); the request then runs as usual."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=2, structured=REGEX)
            await _compiles(p, d)
            d.send(GrammarReady("r1"))
            await d.assert_silent()         # P still compiles: no reservation yet
            p.send(GrammarReady("r1"))
            req = await d.expect(DecodeRequest)
            assert req.params.structured == REGEX
            d.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, ""))
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "stop"))
            while (final := await out.next()) is not END and not final.finished:
                pass
            assert view(final) == ([([11, 12], "ab", "stop")], True)
            await p.assert_silent(), await d.assert_silent()
    run(test)


def test_a_decode_nodes_busy_compiler_is_a_busy_round_on_another_decode_node():
    """D answers Busy (too many compiles there): the router takes P's answer too (none is left to
    be taken for a later round's), then asks the other decode node; nothing is reserved on D."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=1, structured=REGEX)
            await _compiles(p, d)
            d2 = await c.node("decode-1", "decode")
            d.send(Busy("r1", "18 grammars are compiling or queued on this node", 50))
            p.send(GrammarReady("r1"))
            await _compiles(p, d2)
            p.send(GrammarReady("r1"))
            d2.send(GrammarReady("r1"))
            await d2.expect(DecodeRequest)
            d2.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, "length"))
            assert view(await out.next()) == ([([11], "a", "length")], True)
            await d.assert_silent()
    run(test)


def test_nothing_is_booked_while_the_grammar_compiles():
    """While P and D compile, neither is booked (a slow compile holds no decode capacity in the
    router's view); once both hold the grammar, both are, and D gets its DecodeRequest."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            c.generate(max_tokens=2, structured=REGEX)
            await _compiles(p, d)
            registry = c.backend.server.registry
            decode, prefill = registry.get("decode-0"), registry.get("prefill-0")
            d.send(GrammarReady("r1"))
            await d.assert_silent()
            assert [(n.inflight_requests, n.pending_blocks) for n in (decode, prefill)] == [(0, 0), (0, 0)]
            p.send(GrammarReady("r1"))
            await d.expect(DecodeRequest)
            assert [(n.inflight_requests, n.pending_blocks) for n in (decode, prefill)] == [(1, 2), (1, 2)]
    run(test)


def test_a_prefill_nodes_busy_compiler_is_asked_again_after_its_retry_hint():
    """D compiled it, P (the only prefill node) answers Busy (its load: too many compiles, or past
    its time limit): nothing is reserved, and once P's retry hint has passed both are asked to
    compile again; then the request runs as usual, and P's first token ends the wait (a later
    Busy, e.g. in a migration, would start its admission timeout afresh)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(max_tokens=2, structured=REGEX)
            await _compiles(p, d)
            choice = c.backend._requests["r1"].choices[0]
            p.send(Busy("r1", "the grammar did not compile within 5.0 s", 50))
            d.send(GrammarReady("r1"))
            await _compiles(p, d)
            assert choice.busy_prefills.replies == 1 and choice.busy_prefills.deadline is not None
            p.send(GrammarReady("r1"))
            d.send(GrammarReady("r1"))
            await d.expect(DecodeRequest)
            d.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            assert (choice.busy_prefills.replies, choice.busy_prefills.deadline) == (0, None)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
    run(test)


def test_a_decode_node_lost_after_an_earlier_rounds_compile_does_not_fail_the_next_round():
    """D0 compiled the grammar, P answered Busy, and D0 is lost while the request waits for P's
    retry hint: D0 holds nothing of the request, so the next round (on D1, the same attempt) runs
    as usual; no retry is used (none is allowed here)."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, heartbeat_timeout_s=1.0, max_retries=0)) as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=2, structured=REGEX)
            d0, _ = await first_of(ds, CompileGrammar)
            await p.expect(CompileGrammar)
            d1 = ds[1 - ds.index(d0)]
            d0.send(GrammarReady("r1"))
            p.send(Busy("r1", "18 grammars are compiling", 2500))   # asked again in 2.5 s
            d0.die()                        # lost by its silence (1 s) while the request waits
            await _compiles(d1, p)          # round 2, the same attempt
            choice = c.backend._requests["r1"].choices[0]
            assert (choice.num_attempts, choice.attempt.decode_id) == (1, d1.node_id)
            d1.send(GrammarReady("r1"))
            p.send(GrammarReady("r1"))
            assert (await d1.expect(DecodeRequest)).rid == "r1"
            d1.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            p.send(FirstToken("r1", 11, "a", None, ""))
            d1.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
            while (final := await out.next()) is not END and not final.finished:
                pass
            assert view(final) == ([([11, 12], "ab", "length")], True)
    run(test)


def test_a_prefill_nodes_busy_compiler_sends_the_request_to_another_prefill_node():
    """P answers Busy with a retry hint of a minute: the other prefill node compiles at once."""
    async def test():
        async with Cluster() as c:
            ps = [await c.node("prefill-0", "prefill"), await c.node("prefill-1", "prefill")]
            d = await c.node("decode-0", "decode")
            c.generate(max_tokens=1, structured=REGEX)
            busy, _ = await first_of(ps, CompileGrammar)
            await _compiles(d)
            busy.send(Busy("r1", "18 grammars are compiling or queued on this node", 60_000))
            d.send(GrammarReady("r1"))
            other = ps[1 - ps.index(busy)]
            await _compiles(other, d)
            await busy.assert_silent()
    run(test)


def test_a_prefill_node_busy_for_the_admission_timeout_is_a_503_and_nothing_is_reserved():
    """P stays busy (its retry hint outlasts the admission timeout): a 503 naming P's reason once
    the timeout has passed, both nodes aborted, no DecodeRequest sent (no KV reserved for nothing)."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, admission_timeout_s=2.0)) as c:
            p, d = await c.pair()
            out = c.generate(structured=REGEX)
            await _compiles(p, d)
            d.send(GrammarReady("r1"))
            p.send(Busy("r1", "the grammar did not compile within 5.0 s", 60_000))
            err = await out.next()
            assert isinstance(err, NoNodeAvailable) and "every prefill node was busy" in str(err) \
                and "prefill-0: the grammar did not compile" in str(err)
            assert (await d.expect(AbortRequest)).rid == "r1" and (await p.expect(AbortRequest)).rid == "r1"
            await d.assert_silent(), await p.assert_silent()
    run(test)


def test_a_grammar_the_decode_node_cannot_compile_is_a_400_at_once():
    """D's non-retryable RequestFailed (the grammar does not compile, or not in time) is a 400
    without waiting for P, whose compile is aborted."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            out = c.generate(structured=REGEX)
            await _compiles(p, d)
            d.send(RequestFailed("r1", "invalid grammar: it did not compile within 5.0 s", False))
            err = await out.next()
            assert isinstance(err, ValueError) and "did not compile" in str(err)
            assert (await p.expect(AbortRequest)).rid == "r1"
    run(test)


def test_a_busy_hint_of_zero_waits_the_least_admission_wait():
    """A prefill node's Busy with retry_after_ms=0 is asked again after ADMISSION_FIRST_WAIT_S, not
    at once in a loop until the admission timeout."""
    busy = BusyPrefills()
    busy.note("prefill-0", "prefill-0: busy", 0.0, 10.0, 30.0)
    assert busy.refused("prefill-0", 10.0) and busy.next_retry(10.0) == 10.0 + ADMISSION_FIRST_WAIT_S
    assert not busy.refused("prefill-0", 10.0 + ADMISSION_FIRST_WAIT_S)


@pytest.mark.parametrize("on_prefills, says", [(True, "every prefill node was busy"), (False, "no decode node had room")])
def test_the_admission_timeouts_reason_names_what_the_last_round_waited_for(on_prefills, says):
    """A prefill node's earlier Busy does not make a timeout spent waiting for decode room a
    'prefill nodes busy' 503."""
    choice = Choice(0, "r1", SamplingParams())
    choice.busy_prefills.note("prefill-0", "prefill-0: busy", 0.05, 0.0, 30.0)
    rounds = _Rounds(30.0, 4, on_prefills=on_prefills)
    assert Admission._timeout_reason(SimpleNamespace(_config=CONFIG), rounds, choice).startswith(says)


def test_an_attempt_id_past_the_wire_limit_fails_the_request():
    """The `~k` suffix of the k-th attempt may not carry a request id past MAX_RID_LEN."""
    Attempt("r" * (MAX_RID_LEN - 4) + "~999", [1], SamplingParams(), 0, 0)
    with pytest.raises(RuntimeError, match="too many attempts"):
        Attempt("r" * (MAX_RID_LEN - 4) + "~1000", [1], SamplingParams(), 0, 0)
