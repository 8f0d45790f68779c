"""Admission against scripted node peers (tests/disagg_harness.py): bursts spread over equal nodes,
Busy decode nodes are not asked again in a loop, and 503s name their cause."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdwire.control import DecodeRequest, FirstToken, PrefillRequest
from pdwire.messages import Busy, Reserved
from router.backend import NoNodeAvailable
from router.cluster.admission import Admission
from tests.disagg_harness import CONFIG, END, HANG_S, Cluster, ScriptedNode, counter, run, until

# No test here is about heartbeats: a generous timeout keeps a loaded machine from losing nodes
STEADY = dataclasses.replace(CONFIG, heartbeat_timeout_s=10.0)

BURST = 48


class Responder:
    """Answers a scripted node's requests as a node would: a decode node reserves (or says Busy
    while `busy`), a prefill node finishes the request with its first token."""

    def __init__(self, node: ScriptedNode):
        self.node, self.busy, self.rids = node, False, []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            msg = await self.node.inbox.get()
            if isinstance(msg, DecodeRequest):
                self.rids.append(msg.rid)
                self.node.send(Busy(msg.rid, "no free KV blocks", 50) if self.busy
                               else Reserved(msg.rid, f"x-{msg.rid}", (3, 4), 0))
            elif isinstance(msg, PrefillRequest):
                self.rids.append(msg.rid)
                self.node.send(FirstToken(msg.rid, 11, "a", None, "length"))


async def _cluster_nodes(c: Cluster, prefill: int, decode: int) -> tuple[list[Responder], list[Responder]]:
    ps = [Responder(await c.node(f"prefill-{i}", "prefill")) for i in range(prefill)]
    ds = [Responder(await c.node(f"decode-{i}", "decode")) for i in range(decode)]
    return ps, ds


async def _finish(outs: list) -> list:
    """The last output of every stream (each must end)."""
    finals = []
    for out in outs:
        final = None
        while (item := await out.next()) is not END:
            assert not isinstance(item, Exception), item
            final = item
        finals.append(final)
    return finals


def _free(c: Cluster, node: ScriptedNode) -> int | None:
    """The node's free blocks by its last heartbeat the router handled (None before any)."""
    status = c.backend.server.info(node.node_id).status
    return None if status is None else status.num_free_blocks


def _idle(c: Cluster) -> list[tuple[int, int, int]]:
    return [(n.inflight_requests, n.inflight_blocks, n.pending_requests)
            for n in c.backend.server.registry.nodes()]


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_a_burst_spreads_evenly_over_equal_nodes(num_nodes):
    """48 requests arriving at once (between two heartbeats) split evenly over equal decode nodes
    and over equal prefill nodes: each is booked on its nodes the moment they are chosen."""
    async def test():
        async with Cluster(STEADY) as c:
            ps, ds = await _cluster_nodes(c, num_nodes, num_nodes)
            outs = [c.generate(f"r{i}", prompt=[100 + i, 5, 6, 7, 8, 9], max_tokens=2) for i in range(BURST)]
            finals = await _finish(outs)
            assert all(f.finished and f.outputs[0].token_ids == [11] for f in finals)
            share = BURST // num_nodes
            assert [len(r.rids) for r in ds] == [share] * num_nodes
            assert [len(r.rids) for r in ps] == [share] * num_nodes
            assert _idle(c) == [(0, 0, 0)] * (2 * num_nodes)
    run(test)


def test_busy_nodes_are_not_asked_again_until_they_report_room():
    """Every decode node says Busy (while reporting room): over one second each waiting request
    is refused a few times, not once per retry_after_ms per node; once the nodes report more free
    blocks every request is admitted and finishes, and nothing stays booked."""
    requests, window_s = 16, 1.0

    async def test():
        async with Cluster(STEADY) as c:
            ps, ds = await _cluster_nodes(c, 1, 2)
            for r in ds:
                r.busy, r.node.free_blocks = True, 8
            await until(lambda: all(_free(c, r.node) == 8 for r in ds))     # a heartbeat with 8 free blocks came
            outs = [c.generate(f"r{i}", max_tokens=2) for i in range(requests)]
            await asyncio.sleep(window_s)       # time passes: the Busy replies it brings are counted
            busy = counter(c.backend.collectors()[2], {"role": "decode"})
            assert requests <= busy <= 8 * requests * window_s, busy    # today: ~40 per request
            for r in ds:
                r.busy, r.node.free_blocks = False, 64
            finals = await _finish(outs)
            assert all(f.finished for f in finals)
            assert sum(len(set(r.rids)) for r in ds) <= 2 * requests
            assert sorted(ps[0].rids) == sorted(f"r{i}" for i in range(requests))
            assert _idle(c) == [(0, 0, 0)] * 3
    run(test)


def test_a_request_waits_for_a_heartbeat_with_room_without_asking(monkeypatch):
    """A decode node that reports too few free blocks is not asked (the timer that would ask it
    anyway is held off); the heartbeat that reports room admits the request."""
    waits = []
    wait_for_room = Admission._wait_for_room

    async def counted(self, rounds):
        waits.append(rounds.need_blocks)
        await wait_for_room(self, rounds)
    monkeypatch.setattr(Admission, "_wait_for_room", counted)
    monkeypatch.setattr(Admission, "_jittered", lambda self, wait_s: HANG_S)

    async def test():
        async with Cluster(STEADY) as c:
            ps, (d,) = await _cluster_nodes(c, 1, 1)
            d.node.free_blocks = 1
            await until(lambda: _free(c, d.node) == 1)
            out = c.generate(max_tokens=2)      # needs 2 blocks
            await until(lambda: waits)          # admission found no room: it waits, asking nobody
            assert waits[0] == 2 and d.rids == []
            d.node.free_blocks = 2
            await _finish([out])
            assert d.rids == ["r1"] and counter(c.backend.collectors()[2], {"role": "decode"}) == 0
    run(test)


@pytest.mark.parametrize("roles, missing", [(("decode",), "prefill"), (("prefill",), "decode"),
                                            ((), "prefill or decode")])
def test_no_live_node_names_the_empty_pool(roles, missing):
    """A fresh request with an empty pool fails at once with a 503 naming that pool."""
    async def test():
        async with Cluster(STEADY) as c:
            for role in roles:
                await c.node(f"{role}-0", role)
            err = await c.generate().next()
            assert isinstance(err, NoNodeAvailable) and str(err) == f"no live {missing} node"
    run(test)


def test_every_decode_node_busy_until_the_timeout_says_so():
    """Busy until the admission timeout: the 503 says every decode node was busy, and why."""
    async def test():
        async with Cluster(dataclasses.replace(STEADY, admission_timeout_s=0.4)) as c:
            _, ds = await _cluster_nodes(c, 1, 2)
            for r in ds:
                r.busy = True
            err = await c.generate().next(timeout=2.0)
            assert isinstance(err, NoNodeAvailable)
            assert str(err).startswith("every decode node was busy for the admission timeout of 0.4 s (")
            assert str(err).endswith(": no free KV blocks)")
    run(test)


def test_a_decode_node_that_does_not_answer_is_named():
    """A decode node silent on the reservation until the admission timeout is named in the 503."""
    async def test():
        async with Cluster(dataclasses.replace(STEADY, admission_timeout_s=0.3)) as c:
            await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            out = c.generate()
            await d.expect(DecodeRequest)
            err = await out.next(timeout=2.0)
            assert isinstance(err, NoNodeAvailable)
            assert str(err) == ("decode node decode-0 did not answer the reservation within the "
                                "admission timeout of 0.3 s")
    run(test)


def test_busy_releases_both_bookings():
    """A Busy reply releases the request's bookings on D and P at once."""
    async def test():
        async with Cluster(STEADY) as c:
            p = await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            c.generate()
            req = await d.expect(DecodeRequest)
            assert _idle(c) == [(1, 2, 1), (1, 2, 1)]     # decode-0, prefill-0: the prompt's 2 blocks
            d.send(Busy(req.rid, "no free KV blocks", 60_000))
            await until(lambda: _idle(c) == [(0, 0, 0), (0, 0, 0)])
            await p.assert_silent(0.05)
    run(test)
