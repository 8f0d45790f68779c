"""--routing cost against scripted nodes (tests/disagg_harness.py): the nodes' KV events steer the
decode and prefill choices, a short uncached tail is prefilled on the decode node (no prefill
node takes part), and the index follows node epochs; --routing affinity ignores the events."""
from __future__ import annotations

import dataclasses

from pdwire.block_hash import chain_hashes
from pdwire.control import AbortRequest, DecodeRequest, PrefillRequest, TokenDelta
from pdwire.messages import Reserved
from router.cluster.registry import NodeRole
from tests.disagg_harness import BLOCK, CONFIG, END, Cluster, counter, publish_kv, run, until, view

PROMPT = list(range(20, 36))                  # 4 blocks of 4; 3 usable (the last token is computed)
HASHES = chain_hashes(PROMPT, BLOCK)
LOCAL = dataclasses.replace(CONFIG, local_prefill_tokens=4)


def test_a_short_uncached_tail_is_prefilled_on_the_decode_node_that_holds_the_rest():
    """d2 holds 3 of the 4 blocks: the request goes to d2 with local_prefill, no prefill node hears
    of it, d2's deltas from token 0 are the output, and nothing stays booked."""
    async def test():
        async with Cluster(LOCAL) as c:
            p = await c.node("prefill-0", "prefill")
            d1, d2 = await c.node("decode-1", "decode"), await c.node("decode-2", "decode")
            await publish_kv(c, d2, HASHES)
            out = c.generate(prompt=PROMPT, max_tokens=3)
            req = await d2.expect(DecodeRequest)
            assert req.local_prefill and req.prefill_node_id == "decode-2"
            d2.send(Reserved("r1", "local", (5, 6, 7, 8), 3))
            d2.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, ""))
            assert view(await out.next()) == ([([11, 12], "ab", None)], False)
            d2.send(TokenDelta("r1", 2, (13,), 2, "c", None, "length"))
            final = await out.next()
            assert view(final) == ([([11, 12, 13], "abc", "length")], True) and final.num_cached_tokens == 12
            assert await out.next() is END
            await p.assert_silent(), await d1.assert_silent(), await d2.assert_silent()
            assert counter(c.backend._admission.prefills, {"where": "local"}) == 1
            assert [(n.inflight_requests, n.inflight_blocks) for n in c.backend.server.registry.nodes()] \
                == [(0, 0)] * 3
    run(test)


def test_a_longer_tail_goes_to_the_prefill_node_whose_events_hold_most():
    """With 4 uncached tokens over a threshold of 3, d2 (the overlap) still decodes, but the prompt
    is computed by a prefill node: p2, whose own events say it holds the prompt's blocks."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, local_prefill_tokens=3)) as c:
            p1, p2 = await c.node("prefill-1", "prefill"), await c.node("prefill-2", "prefill")
            await c.node("decode-1", "decode")
            d2 = await c.node("decode-2", "decode")
            await publish_kv(c, d2, HASHES), await publish_kv(c, p2, HASHES[:2])
            out = c.generate(prompt=PROMPT, max_tokens=3)
            req = await d2.expect(DecodeRequest)
            assert not req.local_prefill and req.prefill_node_id == "prefill-2"
            d2.send(Reserved("r1", "x1", (5, 6, 7, 8), 3))
            pre = await p2.expect(PrefillRequest)
            assert pre.cached_prefix_blocks == 3
            await p1.assert_silent()
            assert counter(c.backend._admission.prefills, {"where": "remote"}) == 1
            out.task.cancel()
    run(test)


def test_events_of_a_stale_epoch_are_dropped_and_a_new_epoch_clears_the_nodes_entries():
    """KVEvents naming another epoch change nothing (counted as dropped); the node's restart
    (a hello with a new epoch) forgets its entries; its snapshot (reset) fills them again."""
    async def test():
        async with Cluster(LOCAL) as c:
            await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            await publish_kv(c, d, HASHES, epoch="old")
            assert c.backend.kv_index.size("decode-0") == 0
            await publish_kv(c, d, HASHES)
            await d.hello(epoch="e2")
            assert c.backend.kv_index.size("decode-0") == 0
            await publish_kv(c, d, HASHES[:2], reset=True)
            assert c.backend.kv_index.matched_blocks("decode-0", HASHES) == 2
    run(test)


def test_aborting_a_local_prefill_tells_only_the_decode_node():
    """The client going away during a local prefill aborts it on the decode node alone."""
    async def test():
        async with Cluster(LOCAL) as c:
            p = await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            await publish_kv(c, d, HASHES)
            c.generate(prompt=PROMPT, max_tokens=3)
            await d.expect(DecodeRequest)
            d.send(Reserved("r1", "local", (5, 6, 7, 8), 3))
            await until(lambda: c.backend.placement("r1") == [("", "decode-0")])
            await c.backend.abort("r1")
            assert (await d.expect(AbortRequest)).rid == "r1"
            await p.assert_silent()
    run(test)


def test_affinity_routing_ignores_kv_events_and_always_uses_a_prefill_node():
    """--routing affinity: the events change nothing; the prompt goes through the prefill node."""
    async def test():
        async with Cluster(dataclasses.replace(LOCAL, routing="affinity")) as c:
            p = await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            await publish_kv(c, d, HASHES)
            c.generate(prompt=PROMPT, max_tokens=3)
            req = await d.expect(DecodeRequest)
            assert not req.local_prefill and req.prefill_node_id == "prefill-0"
            d.send(Reserved("r1", "x1", (5, 6, 7, 8), 3))
            await p.expect(PrefillRequest)
    run(test)


DOC = list(range(100, 132))                   # a document of 8 full blocks, cached on d1
BURST = 8


def _questions() -> list[list[int]]:
    """BURST prompts of the document and a 2-token question each: 9 blocks, 8 usable, all cached on d1."""
    return [DOC + [200 + 2 * i, 201 + 2 * i] for i in range(BURST)]


def test_a_burst_on_a_document_one_decode_node_holds_stays_on_it():
    """d1 holds the document (its KV events), d2 nothing; 8 questions on it arrive before either
    node answers (their bookings stay pending, whatever the heartbeats): each is booked on d1 with
    the 1 block d1 must allocate (9 - the 8 it holds), so d1 stays cheaper (1 + k against 9) and
    takes all 8; once they end (half of them taken by d1, half not yet), nothing stays booked."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            d1, d2 = await c.node("decode-1", "decode"), await c.node("decode-2", "decode")
            await publish_kv(c, d1, chain_hashes(DOC, BLOCK))
            outs = [c.generate(f"r{i}", prompt=q, max_tokens=3) for i, q in enumerate(_questions())]
            await until(lambda: d1.inbox.qsize() + d2.inbox.qsize() == BURST)
            assert (d1.inbox.qsize(), d2.inbox.qsize()) == (BURST, 0)
            reg = c.backend.server.registry
            assert (reg.get("decode-1").inflight_blocks, reg.get("decode-1").unreported_blocks) == (BURST, BURST)
            for i in range(BURST // 2):             # d1 takes half of them: their bookings are taken
                req = await d1.expect(DecodeRequest)
                d1.send(Reserved(req.rid, f"x{i}", tuple(range(9 * i, 9 * i + 9)), 8))
            await until(lambda: reg.get("decode-1").pending_requests == BURST // 2)
            assert reg.get("decode-1").pending_blocks == BURST // 2
            for out in outs:
                out.task.cancel()
            await until(lambda: all(n.inflight_requests == 0 for n in reg.nodes()))
            assert [(n.inflight_blocks, n.pending_requests, n.pending_blocks) for n in reg.nodes()] == [(0, 0, 0)] * 3
    run(test)


def test_questions_on_a_document_one_node_holds_idle_stay_there_once_it_is_in_use():
    """d1 holds the document, idle (no request uses it); the first question takes it into use
    (d1's Reserved: 9 blocks taken). The next questions still go to d1: its cost counts the
    document as in use (1 uncached + 9 used + the 1 block it adds, then 1 more a question), d2's
    the 9 blocks it would compute and the 9 it would add (18). Without the blocks a node adds,
    d2 (9) undercut d1 (1 + 9) and received a question whose whole document it had to compute."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            d1, d2 = await c.node("decode-1", "decode"), await c.node("decode-2", "decode")
            await publish_kv(c, d1, chain_hashes(DOC, BLOCK))
            outs = []
            for i, q in enumerate(_questions()[:4]):
                outs.append(c.generate(f"r{i}", prompt=q, max_tokens=3))
                req = await d1.expect(DecodeRequest)
                d1.send(Reserved(req.rid, f"x{i}", tuple(range(9 * i, 9 * i + 9)), 8, 9 if i == 0 else 1))
                await until(lambda: c.backend.server.registry.get("decode-1").pending_requests == 0)
            await d2.assert_silent()
            for out in outs:
                out.task.cancel()
    run(test)


def test_a_burst_on_a_document_both_decode_nodes_hold_spreads_by_their_queued_prefills():
    """Both nodes hold the document; d2 reports 3 blocks in use, d1 none. 4 questions of 6 tokens
    (10 blocks, 2 past the 8 held: each prefilled on its decode node) arrive before either node
    answers: each booking adds 2 blocks in use and 2 of queued prefill on its node, so d1 costs
    4 + 4k, d2 7 + 4j (2 uncached, the 2 blocks the node adds, its queued and used), and they go
    d1, d2, d1, d2 (without the queued prefill, 4 + 2k against 7 + 2j: d1, d1, d2, d1); once they end, no prefill work stays booked on either."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, local_prefill_tokens=8)) as c:
            await c.node("prefill-0", "prefill")
            d1, d2 = await c.node("decode-1", "decode"), await c.node("decode-2", "decode")
            d2.free_blocks = 61
            for d in (d1, d2):
                await publish_kv(c, d, chain_hashes(DOC, BLOCK))
            await until(lambda: c.backend.server.info("decode-2").status.num_free_blocks == 61)
            outs, placed = [], []
            for i in range(4):
                before = d1.inbox.qsize()
                outs.append(c.generate(f"r{i}", prompt=DOC + list(range(300 + 6 * i, 306 + 6 * i)), max_tokens=3))
                await until(lambda: d1.inbox.qsize() + d2.inbox.qsize() == i + 1)
                placed.append("d1" if d1.inbox.qsize() > before else "d2")
            assert placed == ["d1", "d2", "d1", "d2"]
            reqs = [d.inbox.get_nowait() for d in (d1, d1, d2, d2)]
            assert all(isinstance(r, DecodeRequest) and r.local_prefill for r in reqs)
            reg = c.backend.server.registry
            assert [n.unreported_prefill_blocks for n in reg.nodes(NodeRole.DECODE)] == [4, 4]
            for out in outs:
                out.task.cancel()
            await until(lambda: all(n.inflight_requests == 0 for n in reg.nodes()))
            assert [n.unreported_prefill_blocks for n in reg.nodes()] == [0, 0, 0]
    run(test)


def test_a_request_with_prompt_logprobs_is_booked_with_every_prompt_block():
    """Prompt logprobs make d1 compute every prompt token (it reuses no cached block): its booking
    on d1 counts all 9 blocks, not the 1 d1 lacks."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            d1 = await c.node("decode-1", "decode")
            await publish_kv(c, d1, chain_hashes(DOC, BLOCK))
            out = c.generate(prompt=_questions()[0], max_tokens=3, prompt_logprobs=1)
            await d1.expect(DecodeRequest)
            assert c.backend.server.registry.get("decode-1").inflight_blocks == 9
            out.task.cancel()
    run(test)
