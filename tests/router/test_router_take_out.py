"""A node's take-out as KVMoves runs it (router/cluster/kv_move.py steps 1 and 5): which requests it
pauses and when, what it waits for before the node may go, and that it keeps nothing behind; a
control server that keeps what it is asked to send stands in for the nodes."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdwire.control import TokenDelta
from pdwire.sampling_params import SamplingParams
from router.cluster.disagg_request import Attempt
from router.cluster.kv_move import KVMoves, MoveOut
from router.cluster.membership import LossCause, NodeLoss
from tests.disagg_harness import PROMPT


class _MovingAttempt:
    """An attempt still decoding on node "d" (hashable, as KVMoves keeps them in sets)."""
    ended, decode_id, writer = False, "d", None


def test_a_settled_wait_that_times_out_leaves_nothing_behind():
    """The take-out's wait_for gives up on settled() while a move is under way: the node's moving
    set and wakeup event go with it, not kept for a node that is gone."""
    moves = KVMoves(1.0, None, None, {}, None, None, None, 0)
    moves._moving["d"] = {_MovingAttempt()}

    async def test():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(moves.settled("d"), 0.05)
    asyncio.run(test())
    assert moves._moving == {} and moves._wakeups == {}


class _Sent:
    """A control server that keeps what it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, node_id: str, msg: object) -> None:
        self.sent.append((node_id, msg))

    def info(self, node_id: str):
        return SimpleNamespace(hello=SimpleNamespace(epoch=f"{node_id}-e1"))


def test_a_take_out_pauses_each_request_at_once_not_behind_the_deltas_it_has_yet_to_merge():
    """start() sends D1 the PauseRequest of each request decoding there when it is called, while
    the attempt's inbox still holds deltas not merged yet (a router behind its nodes): had the
    pause waited for the stream to reach its MoveOut, D1 could finish the request first and
    nothing would move. Attempts not decoding there, finished or moving already get none."""
    atts = {rid: Attempt(rid, list(PROMPT), SamplingParams(max_tokens=400), 0, 0) for rid in ("r1", "r2", "r3", "r4", "r5")}
    for rid, att in atts.items():
        att.decode_id, att.first_token, att.streaming = "d1", True, True
    atts["r2"].decode_id = "d2"
    atts["r3"].decode_done = True
    atts["r4"].writer = "d0"
    atts["r5"].first_token = atts["r5"].streaming = False     # still prefilling: nothing on D1 to move
    backlog = [("d1", TokenDelta("r1", i, (20 + i,), i, "x", None, "")) for i in range(50)]
    for item in backlog:
        atts["r1"].inbox.put_nowait(item)
    server = _Sent()
    moves = KVMoves(1.0, server, None, atts, None, None, None, 0)
    loss = NodeLoss(LossCause.REMOVED)

    async def test():
        now = asyncio.get_running_loop().time()
        assert moves.start("d1", loss)
        assert [(node, type(msg).__name__, msg.rid) for node, msg in server.sent] == [("d1", "PauseRequest", "r1")]
        queued = [atts["r1"].inbox.get_nowait() for _ in range(len(backlog) + 1)]
        assert queued[:-1] == backlog                   # its stream still merges them first
        out = queued[-1]
        assert (out.node_id, out.loss, out.epoch) == ("d1", loss, "d1-e1") and now <= out.since   # the move's clock
        assert moves.start("d2", loss) and [msg.rid for _, msg in server.sent] == ["r1", "r2"]
    asyncio.run(test())


@pytest.mark.parametrize("r1_first", [True, False], ids=["r1-lands-first", "r5-streams-first"])
def test_a_take_out_also_moves_a_request_that_began_decoding_on_the_node_after_it_started(r1_first):
    """r5 was still prefilling when the take-out started (no delta from D1 yet: nothing there to
    pause); the take-out waits for it as for a move, and pauses it once D1's first delta for it is
    merged, whether r1's move lands before or after that: settled() returns only once r5's move is
    over, so the node is not removed under a request it could have moved."""
    atts = {rid: Attempt(rid, list(PROMPT), SamplingParams(max_tokens=400), 0, 0) for rid in ("r1", "r5")}
    for att in atts.values():
        att.decode_id, att.first_token = "d1", True
    atts["r1"].streaming = True
    server = _Sent()
    moves = KVMoves(1.0, server, None, atts, None, None, None, 0)
    delta = ("d1", TokenDelta("r5", 0, (20,), 0, "x", None, ""))

    async def test():
        assert moves.start("d1", NodeLoss(LossCause.DRAINED))
        settled = asyncio.ensure_future(moves.settled("d1"))
        for step in (("land", "stream") if r1_first else ("stream", "land")):
            await asyncio.sleep(0)
            if step == "land":
                atts["r1"].ended = True
                moves.ended(atts["r1"])
            else:
                moves.note(atts["r5"], delta)       # D1's first delta for r5, merged
            await asyncio.sleep(0)
            assert not settled.done()
        assert [msg.rid for _, msg in server.sent] == ["r1", "r5"]
        assert isinstance(atts["r5"].inbox.get_nowait(), MoveOut)
        atts["r5"].ended = True
        moves.ended(atts["r5"])
        await asyncio.wait_for(settled, 1.0)
        assert [msg.rid for _, msg in server.sent] == ["r1", "r5"]      # paused once each
    asyncio.run(test())
    assert moves._moving == {} and moves._losses == {} and moves._wakeups == {}


def test_a_take_out_waits_for_a_request_on_its_way_to_the_node():
    """Nothing decodes on D1 yet but r5's first token is out and its blocks are on their way there:
    start() does not remove D1 at once (True); its first delta makes it movable, and it is paused.
    One still in admission (no first token) is not waited for."""
    att = Attempt("r5", list(PROMPT), SamplingParams(max_tokens=400), 0, 0)
    att.decode_id = "d1"
    server = _Sent()
    moves = KVMoves(1.0, server, None, {"r5": att}, None, None, None, 0)

    async def test():
        assert not moves.start("d1", NodeLoss(LossCause.REMOVED))
        att.first_token = True
        assert moves.start("d1", NodeLoss(LossCause.REMOVED)) and server.sent == []
        settled = asyncio.ensure_future(moves.settled("d1"))
        await asyncio.sleep(0)
        moves.note(att, ("d1", TokenDelta("r5", 0, (20,), 0, "x", None, "")))
        await asyncio.sleep(0)
        assert [msg.rid for _, msg in server.sent] == ["r5"] and not settled.done()
        att.ended = True
        moves.ended(att)
        await asyncio.wait_for(settled, 1.0)
    asyncio.run(test())


def test_a_take_out_that_finds_nothing_to_move_keeps_nothing():
    """start() on a node with nothing decoding: False (the node is removed at once), and nothing
    kept for it."""
    moves = KVMoves(1.0, _Sent(), None, {}, None, None, None, 0)

    async def test():
        assert not moves.start("d1", NodeLoss(LossCause.REMOVED))
    asyncio.run(test())
    assert moves._moving == {} and moves._losses == {}
