"""Moves an operator causes use none of a request's max_retries (Failure.uses_retry): a KV move, a
failed one's re-prefill fallback, a removed node's re-prefill move; a failure of the request's own
(a node failing it) uses one, once. Scripted nodes over the real control plane."""
from __future__ import annotations

import dataclasses

import pytest

from pdwire.control import (AbortRequest, DecodeRequest, FirstToken, Paused, PauseRequest,
                            RequestFailed, ShipRequest, TokenDelta)
from pdwire.messages import Busy, Reserved
from tests.disagg_harness import CONFIG, PROMPT, Cluster, first_of, run, until, view
from tests.router.test_router_kv_move import _leaves, finish, paused_after_13, prefill_request, shipping
from tests.router.test_router_operator import cast, first_tokens, membership


async def _moved(c, d_from, rest, rid: str, xfer: str):
    """The operator removes d_from, which pauses `rid`; the request's next attempt is reserved on
    one of `rest` and d_from told to ship into it. Returns (that node, the moved attempt's rid)."""
    c.remove(d_from.node_id)                # answers once rid has moved
    assert (await d_from.expect(PauseRequest)).rid == rid
    d_from.send(Paused(rid, 2, 1))          # 2 tokens held here, 1 character before the last
    d_to, req = await first_of(rest, DecodeRequest)
    d_to.send(Reserved(req.rid, xfer, (7, 8), 0))
    assert (await d_from.expect(ShipRequest)).rid == req.rid
    assert (await d_from.expect(AbortRequest)).rid == rid
    return d_to, req.rid


def test_a_request_moved_more_often_than_max_retries_still_completes_exactly():
    """max_retries = 1: r1 moves with its KV blocks twice (decode-a to b to c), then c fails it
    once: it is re-prefilled from every emitted token and completes with exactly the tokens and
    text its nodes made; two kv moves and one retry after a node failure are counted."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=1)) as c:
            p, ds = await cast(c)
            ds.append(await c.node("decode-2", "decode"))
            out = c.generate(max_tokens=6)
            d_a, _ = await first_tokens(p, ds, out)
            d_b, rid = await _moved(c, d_a, [d for d in ds if d is not d_a], "r1", "x2")
            d_b.send(TokenDelta(rid, 0, (12, 13), 0, "bc", None, ""))     # 12: the client's already
            assert view(await out.next()) == ([([11, 12, 13], "abc", None)], False)
            d_c, rid = await _moved(c, d_b, [d for d in ds if d not in (d_a, d_b)], rid, "x3")
            d_c.send(TokenDelta(rid, 0, (13, 14), 0, "cd", None, ""))
            assert view(await out.next()) == ([([11, 12, 13, 14], "abcd", None)], False)
            d_c.send(RequestFailed(rid, "engine step failed", True))
            while not isinstance(again := await d_c.expect(object), DecodeRequest):
                assert again.rid == rid
            assert (again.rid, list(again.prompt_ids), again.params.max_tokens) == \
                ("r1~3", PROMPT + [11, 12, 13, 14], 2)
            d_c.send(Reserved("r1~3", "x4", (7, 8, 9), 0))
            assert (await prefill_request(p)).rid == "r1~3"
            p.send(FirstToken("r1~3", 15, "e", None, ""))
            d_c.send(TokenDelta("r1~3", 0, (15, 16), 0, "ef", None, "length"))
            await finish(out, ([([11, 12, 13, 14, 15, 16], "abcdef", "length")], True))
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="kv_move"}'] == 2
            assert got['pdserve_router_migrations_total{cause="node_failure",how="reprefill"}'] == 1
    run(test)


def test_a_failed_kv_moves_fallback_uses_no_retry():
    """max_retries = 0: the live node answers the move's reservation Busy; r1 still continues,
    re-prefilled from prompt + 11, 12, 13, and completes (the operator's move is no failure)."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=0)) as c:
            p, ds = await cast(c)
            d1, live, out, _ = await paused_after_13(p, ds, c)
            live.send(Busy("r1~1", "no free KV blocks", 10))
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids)) == ("r1~2", PROMPT + [11, 12, 13])
            live.send(Reserved("r1~2", "x3", (7, 8, 9), 0))
            assert (await prefill_request(p)).rid == "r1~2"
            p.send(FirstToken("r1~2", 14, "d", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
    run(test)


def test_a_removed_nodes_re_prefill_move_uses_no_retry():
    """max_retries = 0 and KV moves off: the operator removes r1's decode node; r1 moves
    re-prefilled to the other one and completes."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=0, kv_move_timeout_s=0)) as c:
            p, ds = await cast(c)
            out = c.generate(max_tokens=3)
            d1, live = await first_tokens(p, ds, out)
            assert (await c.backend.operator.remove(d1.node_id)).state == "removed"     # nothing to move: at once
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids)) == ("r1~1", PROMPT + [11, 12])
            live.send(Reserved("r1~1", "x2", (7, 8, 9), 0))
            assert (await prefill_request(p)).rid == "r1~1"
            p.send(FirstToken("r1~1", 13, "c", None, "length"))
            await finish(out, ([([11, 12, 13], "abc", "length")], True))
            assert membership(c.backend)['pdserve_router_migrations_total{cause="removed",how="reprefill"}'] == 1
    run(test)


def test_a_failed_kv_move_after_a_real_failure_uses_one_retry():
    """max_retries = 1: D1 cannot ship the moved attempt (its own RequestFailed): the fallback
    re-prefill uses the one retry (not two), so it runs; when that attempt fails too, r1 fails."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=1)) as c:
            p, d1, live, out = await shipping(c)
            d1.send(RequestFailed("r1~1", "cannot reach the decode node", True))
            assert (await live.expect(AbortRequest)).rid == "r1~1"
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids)) == ("r1~2", PROMPT + [11, 12, 13])
            live.send(Reserved("r1~2", "x3", (7, 8, 9), 0))
            assert (await prefill_request(p)).rid == "r1~2"
            p.send(RequestFailed("r1~2", "out of memory", True))
            err = await out.next()
            assert isinstance(err, RuntimeError) and "after 3 attempts: prefill-0: out of memory" in str(err), err
    run(test)


@pytest.mark.parametrize("lost_by", ["goodbye", "removed"])
def test_a_lost_writers_overdue_failure_costs_a_retry_unless_an_operator_took_the_writer_out(lost_by):
    """max_retries = 0, the live node silent after D1's ShipRequest: D1 lost by a goodbye, the
    overdue loss is a failure of the request's own and r1 fails; D1 taken out by the operator
    (its evacuation wait ran out, so it is lost as removed while still the writer), the overdue
    loss is the operator's move and r1 re-prefills. Either way it happens once: no loop."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=0, kv_move_timeout_s=0.3)) as c:
            p, d1, live, out = await shipping(c)
            if lost_by == "goodbye":
                _leaves(d1)
            await until(lambda: c.backend.server.info(d1.node_id) is None, timeout=5.0)
            assert (await live.expect(AbortRequest)).rid == "r1~1"
            if lost_by == "goodbye":
                err = await out.next()
                assert isinstance(err, RuntimeError) and "node decode" in str(err) and "said goodbye" in str(err), err
            else:
                again = await live.expect(DecodeRequest)
                assert (again.rid, list(again.prompt_ids)) == ("r1~2", PROMPT + [11, 12, 13])
            got = membership(c.backend)
            assert got.get(f'pdserve_router_migrations_total{{cause="{lost_by}",how="reprefill"}}', 0) == \
                (0 if lost_by == "goodbye" else 1)
    run(test)
