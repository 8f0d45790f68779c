"""KV moves as the router runs them (router/cluster/kv_move.py), message by message, with scripted
nodes over the real control plane: a removed decode node's running request moves with its blocks,
and every way that fails falls back to the re-prefill move."""
from __future__ import annotations

import dataclasses

import pytest

from pdwire.control import (AbortRequest, DecodeRequest, FirstToken, NodeGoodbye, Paused,
                            PrefillRequest, RequestFailed, ShipRequest, TokenDelta)
from pdwire.messages import Busy, Reserved
from router.cluster.membership import LossCause, NodeLoss
from router.config import MAX_KV_MOVE_TIMEOUT_S, RouterConfig
from tests.disagg_harness import CONFIG, END, PROMPT, Cluster, run, until, view
from tests.router.test_router_operator import cast, membership, removed_mid_stream


async def paused_after_13(p, ds, c):
    """r1 (max 4 tokens) has 11, 12 when its decode node D1 is removed; D1 sends 13 before it
    pauses holding 3 tokens ("ab" before the last). Returns (D1, the live node, the stream, the
    live node's DecodeRequest)."""
    out = c.generate(max_tokens=4)
    d1, live = await removed_mid_stream(c, p, ds, out)
    d1.send(TokenDelta("r1", 2, (13,), 2, "c", None, ""))
    d1.send(Paused("r1", 3, 2))
    assert view(await out.next()) == ([([11, 12, 13], "abc", None)], False)
    return d1, live, out, await live.expect(DecodeRequest)


async def shipping(c):
    """paused_after_13, then the live node reserves the moved attempt r1~1 and D1 is told to ship
    into it. Returns (P, D1, the live node, the stream)."""
    p, ds = await cast(c)
    d1, live, out, _ = await paused_after_13(p, ds, c)
    live.send(Reserved("r1~1", "x2", (7, 8), 0))
    await d1.expect(ShipRequest)
    return p, d1, live, out


async def prefill_request(p) -> PrefillRequest:
    """The prefill node's next PrefillRequest, past the aborts of earlier attempts."""
    while not isinstance(msg := await p.expect(object), PrefillRequest):
        assert isinstance(msg, AbortRequest)
    return msg


async def finish(out, expected: tuple) -> None:
    while (final := await out.next()) is not END and not final.finished:
        pass
    assert view(final) == expected


def test_a_removed_nodes_request_moves_with_its_kv_blocks_and_continues_exactly():
    """The live node reserves prompt + 11, 12 (13 is the moved attempt's first token, the client's
    already) written by D1 only; D1 is told to ship into it; the live node's deltas from 13 on
    continue the stream without repeating 13; no prefill node prefills; D1 leaves once the live
    node took the blocks; one migration counted as kv_move."""
    async def test():
        async with Cluster() as c:
            p, ds = await cast(c)
            d1, live, out, req = await paused_after_13(p, ds, c)
            assert (req.rid, list(req.prompt_ids), req.params.max_tokens, req.prior_outputs, req.prefill_node_id) == \
                ("r1~1", PROMPT + [11, 12], 2, 2, d1.node_id)
            live.send(Reserved("r1~1", "x2", (7, 8), 1))
            ship = await d1.expect(ShipRequest)
            assert ship == ShipRequest("r1~1", "r1", live.kv_endpoint, "x2", (7, 8), 1)
            assert (await d1.expect(AbortRequest)).rid == "r1"      # after the ShipRequest: nothing held by then
            assert "leave" not in d1.commands                       # the blocks are not adopted yet
            live.send(TokenDelta("r1~1", 0, (13, 14), 0, "cd", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
            await until(lambda: "leave" in d1.commands)
            assert (await p.expect(AbortRequest)).rid == "r1"       # r1's first attempt ended
            await p.assert_silent(0.1)                              # no PrefillRequest: nothing re-prefilled
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="kv_move"}'] == 1
            assert 'pdserve_router_migrations_total{cause="removed",how="reprefill"}' not in got
    run(test)


def test_a_busy_receiver_falls_back_to_the_re_prefill_move():
    """The live node answers the move's reservation Busy: the move is given up (D1 aborted, its
    hold freed), and r1 continues re-prefilled from prompt + 11, 12, 13; counted as reprefill."""
    async def test():
        async with Cluster() as c:
            p, ds = await cast(c)
            d1, live, out, _ = await paused_after_13(p, ds, c)
            live.send(Busy("r1~1", "no free KV blocks", 10))
            assert (await d1.expect(AbortRequest)).rid == "r1"
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids), again.prior_outputs, again.prefill_node_id) == \
                ("r1~2", PROMPT + [11, 12, 13], 3, p.node_id)
            live.send(Reserved("r1~2", "x3", (7, 8, 9), 0))
            await p.expect(AbortRequest)
            assert (await p.expect(PrefillRequest)).rid == "r1~2"
            p.send(FirstToken("r1~2", 14, "d", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="reprefill"}'] == 1
            assert 'pdserve_router_migrations_total{cause="removed",how="kv_move"}' not in got
    run(test)


def _fails_to_ship(d1, live) -> None:
    d1.send(RequestFailed("r1~1", "cannot reach the decode node", True))


def _leaves_then_the_transfer_breaks(d1, live) -> None:
    _leaves(d1)
    live.send(RequestFailed("r1~1", "transfer failed: peer_dead silent for 10s", True))


def _leaves(d1) -> None:
    d1.stop_heartbeat()
    d1.send(NodeGoodbye(d1.node_id, d1.epoch, "SIGTERM"))


@pytest.mark.parametrize("fail, cause", [(_fails_to_ship, "node_failure"),
                                         (_leaves_then_the_transfer_breaks, "node_failure")])
def test_a_writer_failing_after_its_ship_request_falls_back_to_the_re_prefill_move(fail, cause):
    """D1 cannot ship (RequestFailed for the moved attempt), or says goodbye and the live node
    reports the broken transfer: the moved attempt fails at once (not at the move's timeout) and
    is aborted on the live node; r1 continues re-prefilled; the kv move and the re-prefill (by its
    cause) are counted."""
    async def test():
        async with Cluster() as c:
            p, d1, live, out = await shipping(c)
            fail(d1, live)
            assert (await live.expect(AbortRequest)).rid == "r1~1"
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids), again.prefill_node_id) == \
                ("r1~2", PROMPT + [11, 12, 13], p.node_id)
            live.send(Reserved("r1~2", "x3", (7, 8, 9), 0))
            await prefill_request(p)
            p.send(FirstToken("r1~2", 14, "d", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="kv_move"}'] == 1
            assert got[f'pdserve_router_migrations_total{{cause="{cause}",how="reprefill"}}'] == 1
    run(test)


def test_a_writer_lost_right_after_it_paused_is_not_left_to_ship():
    """D1 pauses holding 3 tokens and says goodbye at once, so its loss comes behind the Paused:
    the move does not go on as if D1 held the blocks (its ShipRequest would go nowhere and the
    moved attempt, made after the loss, would wait for a writer that is gone). r1 re-prefills
    from prompt + 11, 12, 13 at once, counted as a re-prefill of the removal, no kv move."""
    async def test():
        async with Cluster() as c:
            p, ds = await cast(c)
            out = c.generate(max_tokens=4)
            d1, live = await removed_mid_stream(c, p, ds, out)
            d1.send(TokenDelta("r1", 2, (13,), 2, "c", None, ""))
            d1.send(Paused("r1", 3, 2))
            _leaves(d1)
            ask = await live.expect(DecodeRequest)
            if ask.prefill_node_id == d1.node_id:        # the move's ask went out before the loss was read
                live.send(Reserved(ask.rid, "x2", (7, 8), 0))
                assert (await live.expect(AbortRequest)).rid == ask.rid
                ask = await live.expect(DecodeRequest)
            assert (list(ask.prompt_ids), ask.prefill_node_id) == (PROMPT + [11, 12, 13], p.node_id)
            live.send(Reserved(ask.rid, "x3", (7, 8, 9), 0))
            await prefill_request(p)
            p.send(FirstToken(ask.rid, 14, "d", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
            got = membership(c.backend)
            assert [k for k in got if "migrations" in k] == \
                ['pdserve_router_migrations_total{cause="removed",how="reprefill"}'], got
    run(test)


def test_a_writer_lost_after_its_ship_request_leaves_the_move_to_the_live_node():
    """D1 says goodbye after its ShipRequest, its blocks already sent: the moved attempt waits for
    the live node, whose deltas from 13 on complete r1; nothing is aborted or re-prefilled, one
    kv move is counted and no re-prefill."""
    async def test():
        async with Cluster() as c:
            p, d1, live, out = await shipping(c)
            _leaves(d1)
            await until(lambda: c.backend.server.info(d1.node_id) is None)
            live.send(TokenDelta("r1~1", 0, (13, 14), 0, "cd", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
            await live.assert_silent(0.1)
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="kv_move"}'] == 1
            assert [k for k in got if "reprefill" in k] == []
    run(test)


def test_a_writer_lost_and_a_silent_live_node_fall_back_at_the_move_timeout():
    """D1 says goodbye after its ShipRequest and the live node says nothing: kv_move_timeout_s
    later (not at once) the moved attempt is aborted there and r1 re-prefills, counted under
    D1's loss (goodbye)."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, kv_move_timeout_s=0.5)) as c:
            p, d1, live, out = await shipping(c)
            _leaves(d1)
            await live.assert_silent(0.25)
            assert (await live.expect(AbortRequest)).rid == "r1~1"
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids)) == ("r1~2", PROMPT + [11, 12, 13])
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="goodbye",how="reprefill"}'] == 1
    run(test)


def test_a_node_that_does_not_pause_in_time_falls_back_and_is_removed():
    """No Paused within kv_move_timeout_s: r1 re-prefills, and the node is told to leave."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, kv_move_timeout_s=0.3)) as c:
            p, ds = await cast(c)
            out = c.generate(max_tokens=4)
            d1, live = await removed_mid_stream(c, p, ds, out)
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids), again.prefill_node_id) == ("r1~1", PROMPT + [11, 12], p.node_id)
            await until(lambda: "leave" in d1.commands)
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="reprefill"}'] == 1
    run(test)


def test_a_paused_reply_claiming_more_text_than_was_sent_falls_back():
    """Paused's character count is a node's word: one past the text the client has (which would
    leave every later delta unmergeable) is refused, and r1 re-prefills instead."""
    async def test():
        async with Cluster() as c:
            p, ds = await cast(c)
            out = c.generate(max_tokens=4)
            d1, live = await removed_mid_stream(c, p, ds, out)
            d1.send(Paused("r1", 2, 999))
            again = await live.expect(DecodeRequest)
            assert (again.rid, list(again.prompt_ids), again.prefill_node_id) == ("r1~1", PROMPT + [11, 12], p.node_id)
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="reprefill"}'] == 1
    run(test)


def test_kv_move_timeout_is_capped_under_the_remove_commands_wait():
    """A remove waits up to 2 x kv_move_timeout_s and `pdserve remove` waits 2 x the cap: a longer
    timeout is refused with its bound named; the cap and 0 (always re-prefill) are taken."""
    with pytest.raises(ValueError, match=r"kv_move_timeout_s must be in \[0, 60\]"):
        RouterConfig(kv_move_timeout_s=MAX_KV_MOVE_TIMEOUT_S + 1)
    with pytest.raises(ValueError, match="kv_move_timeout_s"):
        RouterConfig(kv_move_timeout_s=-1)
    assert RouterConfig(kv_move_timeout_s=MAX_KV_MOVE_TIMEOUT_S).kv_move_timeout_s == 60.0
    assert RouterConfig(kv_move_timeout_s=0).kv_move_timeout_s == 0


def test_a_writer_lost_behind_the_live_nodes_first_delta_is_not_the_moved_attempts_failure():
    """The router lags its nodes: the live node's first delta for the moved attempt reaches the
    router (D1's booking goes with it: D1 is idle), D1 leaves at its next heartbeat, and its loss
    is queued for the attempt, whose writer is still D1, behind that delta. Read in that order,
    the delta ends the attempt's need of D1; the loss that follows is of a node it no longer
    uses: r1 goes on from the live node, one kv move and no re-prefill (it was re-prefilled: a
    CI run of session 26, the e2e drain test)."""
    async def test():
        async with Cluster() as c:
            p, d1, live, out = await shipping(c)
            backend = c.backend
            att = backend._attempts["r1~1"]
            # as the control server's receive loop hands them over, one after the other, before the
            # attempt's task runs: the delta, then the loss
            backend.on_request_message(live.node_id, TokenDelta("r1~1", 0, (13,), 0, "c", None, ""))
            backend.on_node_lost(d1.node_id, NodeLoss(LossCause.DRAINED, "idle"))
            assert att.writer == d1.node_id and att.inbox.qsize() == 2
            await until(lambda: att.writer == "")
            live.send(TokenDelta("r1~1", 1, (14,), 1, "d", None, "length"))
            await finish(out, ([([11, 12, 13, 14], "abcd", "length")], True))
            got = membership(c.backend)
            assert got['pdserve_router_migrations_total{cause="removed",how="kv_move"}'] == 1
            assert [k for k in got if "reprefill" in k] == [], got
    run(test)
