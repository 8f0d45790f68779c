"""The router's view of a decode node's free blocks after the node answers: it books the blocks
the node says its reservation took (Reserved.taken_blocks), which counts the cached blocks no
request used (free on the node until taken) and corrects a stale KV index; the booking comes off
once. The node's side is the real engine Scheduler and BlockManager (tests/decode_blocks.py)."""
from __future__ import annotations

import dataclasses

from pdwire.block_hash import chain_hashes
from pdwire.control import DecodeRequest, FirstToken, PrefillRequest, TokenDelta
from pdwire.messages import Reserved
from router.cluster.registry import NodeLoad, NodeRegistry, NodeRole
from tests.decode_blocks import DecodeBlocks
from tests.disagg_harness import BLOCK, CONFIG, END, Cluster, ScriptedNode, publish_kv, run, until, view

DOCS = [list(range(200 + 40 * i, 200 + 40 * i + 8 * BLOCK)) for i in range(6)]    # 8 blocks each


def _question(doc: int, i: int = 0) -> list[int]:
    """A document and a 2-token question: 9 blocks, its 8 full ones cached where the document is."""
    return DOCS[doc] + [7 + 2 * i, 8 + 2 * i]


async def _answer(d: ScriptedNode, blocks: DecodeBlocks, xfer: str) -> DecodeRequest:
    """d reserves the next DecodeRequest in `blocks` and answers Reserved with the real figures;
    returns the request."""
    req = await d.expect(DecodeRequest)
    got = blocks.reserve(req.rid, list(req.prompt_ids), req.params.max_tokens)
    d.send(Reserved(req.rid, xfer if not req.local_prefill else "local", tuple(got.block_table),
                    got.cached_blocks, got.taken_blocks))
    return req


async def _node(c: Cluster, node_id: str) -> ScriptedNode:
    """A decode node whose last heartbeat shows all 64 blocks free and that sends no other."""
    d = await c.node(node_id, "decode")
    await until(lambda: c.backend.server.info(node_id).status is not None)
    d.stop_heartbeat()
    return d


async def _asked(c: Cluster, max_tokens: int) -> tuple:
    """prefill-0, decode-0 (heartbeats stopped) and a request of 2 blocks asked of decode-0:
    (p, d, decode-0's registry entry, the output, d's DecodeRequest)."""
    p, d = await c.node("prefill-0", "prefill"), await _node(c, "decode-0")
    out = c.generate(max_tokens=max_tokens)
    return p, d, c.backend.server.registry.get("decode-0"), out, await d.expect(DecodeRequest)


def _free_view(c: Cluster, node_id: str) -> int:
    """The decode node's free blocks as admission sees them (DecodePolicy.has_room)."""
    admission = c.backend._admission
    return admission._decode_policy.free_blocks(c.backend.server.registry.get(node_id))


def test_questions_on_different_unused_documents_book_what_the_node_takes():
    """d holds 6 documents of 8 blocks, used by no request (all 64 blocks count free), and the
    router's index knows them: a question on each is booked with 1 block until d answers, then
    with the 9 d took (its 8 cached blocks leave d's free count too): after the 6 answers the
    router sees 10 blocks free, as d has (not 64 - 6 = 58); once they end, nothing stays booked."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await _node(c, "decode-0")
            blocks = DecodeBlocks(64, BLOCK)
            for doc in DOCS:
                blocks.cache(doc)
            await publish_kv(c, d, [h for doc in DOCS for h in chain_hashes(doc, BLOCK)])
            node = c.backend.server.registry.get("decode-0")
            outs = []
            for i in range(len(DOCS)):
                outs.append(c.generate(f"r{i}", prompt=_question(i), max_tokens=3))
                await until(lambda: node.pending_requests == 1)
                assert node.pending_blocks == 1                 # the estimate: the prompt's less the 8 held
                await _answer(d, blocks, f"x{i}")
                await p.expect(PrefillRequest)
            assert blocks.bm.num_free_blocks == _free_view(c, "decode-0") == 64 - 6 * 9
            for out in outs:
                out.task.cancel()
            await until(lambda: node.inflight_requests == 0)
            assert (node.inflight_blocks, node.unreported_blocks, _free_view(c, "decode-0")) == (0, 0, 64)
            blocks.check_integrity()
    run(test)


def test_a_stale_index_is_corrected_by_the_nodes_answer():
    """The index says d holds document 0, but d has evicted it: the question is booked with 1 block
    and 1 of queued prefill (a local prefill), and d's answer (0 cached, 9 taken) makes both 9.
    Then the index lacks document 1, which d holds and a running reservation uses: a question on
    it is booked with all 9 blocks until d says it took 1. After each answer the router sees d's
    free blocks (but for the 9 of that reservation, which the test made behind its back)."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, local_prefill_tokens=4)) as c:
            await c.node("prefill-0", "prefill")
            d = await _node(c, "decode-0")
            blocks = DecodeBlocks(64, BLOCK)
            await publish_kv(c, d, chain_hashes(DOCS[0], BLOCK))
            node = c.backend.server.registry.get("decode-0")
            outs = [c.generate("r0", prompt=_question(0), max_tokens=3)]
            await until(lambda: node.pending_requests == 1)
            assert (node.pending_blocks, node.pending_prefill_blocks) == (1, 1)
            req = await _answer(d, blocks, "x0")
            assert req.local_prefill
            await until(lambda: node.pending_requests == 0)
            assert (node.unreported_blocks, node.unreported_prefill_blocks) == (9, 9)
            assert blocks.bm.num_free_blocks == _free_view(c, "decode-0") == 55
            blocks.cache(DOCS[1])
            blocks.reserve("other", _question(1, 5))            # uses document 1's blocks, unknown to the router
            outs.append(c.generate("r1", prompt=_question(1), max_tokens=3))
            await until(lambda: node.pending_requests == 1)
            assert (node.pending_blocks, node.pending_prefill_blocks) == (9, 0)
            await _answer(d, blocks, "x1")
            await until(lambda: node.pending_requests == 0)
            assert (blocks.bm.num_free_blocks, _free_view(c, "decode-0")) == (45, 45 + 9)   # "other" was never booked
            for out in outs:
                out.task.cancel()
            await until(lambda: node.inflight_requests == 0)
            assert (node.inflight_blocks, node.unreported_blocks, node.unreported_prefill_blocks) == (0, 0, 0)
    run(test)


def test_a_rebooked_reservation_is_released_once_with_what_the_node_took():
    """Booked with 1 block, taken with 9: a release before the next heartbeat takes 9 off (nothing
    stays unreported), one after it takes off the 9 freed since (-9), and a second release nothing;
    an answer that lowers the booking tells waiting admissions there is room."""
    capacity: list[str] = []
    reg = NodeRegistry(60.0, on_capacity=lambda node: capacity.append(node.node_id))
    node = reg.register("d", NodeRole.DECODE, "tcp://d")
    before, after = reg.book("d", 1, 1), reg.book("d", 1, 1)
    reg.taken(before, 9, 9), reg.taken(after, 9, 9)
    assert (node.inflight_blocks, node.unreported_blocks, node.unreported_prefill_blocks) == (18, 18, 18)
    reg.release(before)
    assert (node.inflight_blocks, node.unreported_blocks, node.unreported_prefill_blocks) == (9, 9, 9)
    reg.heartbeat("d", NodeLoad(1))
    reg.release(after), reg.release(after)
    assert (node.inflight_blocks, node.unreported_blocks, node.unreported_prefill_blocks) == (0, -9, 0)
    capacity.clear()
    lower = reg.book("d", 9)
    reg.taken(lower, 1)
    assert (node.inflight_blocks, node.unreported_blocks, capacity) == (1, -8, ["d"])


def test_a_heartbeat_handled_before_the_reserved_is_read_does_not_count_it_twice():
    """d's Reserved reaches the router, then d's next heartbeat (sent after the Reserved, so it
    shows the reservation), both in one turn of the control loop, before the attempt's task reads
    the Reserved: the booking was taken as the Reserved arrived, so after that heartbeat nothing
    of it is unreported (not its 2 blocks a second time, pending or taken), nor once it is read."""
    async def test():
        async with Cluster() as c:
            p, d, node, out, req = await _asked(c, max_tokens=3)
            assert (node.pending_requests, node.pending_blocks) == (1, 2)
            c.backend.on_request_message("decode-0", Reserved(req.rid, "x1", (3, 4), 0, 2))
            c.backend.server.registry.heartbeat("decode-0", NodeLoad(1, 0, 2 / 64))
            assert (node.unreported_requests, node.unreported_blocks) == (0, 0)
            await p.expect(PrefillRequest)          # the attempt's task has read the Reserved
            assert (node.unreported_requests, node.unreported_blocks, node.inflight_blocks) == (0, 0, 2)
            out.task.cancel()
            await until(lambda: node.inflight_requests == 0)
            assert (node.inflight_blocks, node.unreported_blocks) == (0, -2)     # freed since that heartbeat
    run(test)


def test_a_heartbeat_handled_before_the_last_delta_is_read_does_not_count_its_blocks_twice():
    """d's last TokenDelta (the request done, its 2 blocks freed on d) reaches the router, then
    d's next heartbeat (sent after it, so it shows them free), both in one turn of the control
    loop, before the attempt's task reads the delta: the booking was released as the delta
    arrived, so after that heartbeat nothing is booked or unreported (not the 2 blocks still
    booked, nor, once the task reads the delta and releases, -2: freed twice)."""
    async def test():
        async with Cluster() as c:
            p, d, node, out, req = await _asked(c, max_tokens=2)
            d.send(Reserved(req.rid, "x1", (3, 4), 0, 2))
            await p.expect(PrefillRequest)
            p.send(FirstToken(req.rid, 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            c.backend.server.registry.heartbeat("decode-0", NodeLoad(1, 0, 2 / 64))     # shows the reservation
            assert (node.inflight_requests, node.inflight_blocks, node.unreported_blocks) == (1, 2, 0)
            c.backend.on_request_message("decode-0", TokenDelta(req.rid, 0, (11, 12), 0, "ab", None, "length"))
            c.backend.server.registry.heartbeat("decode-0", NodeLoad(0, 0, 0.0))
            assert (node.inflight_requests, node.inflight_blocks, node.unreported_blocks) == (0, 0, 0)
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            assert await out.next() is END                 # the attempt's task has read the delta and ended
            assert (node.inflight_requests, node.inflight_blocks, node.unreported_blocks) == (0, 0, 0)
    run(test)
