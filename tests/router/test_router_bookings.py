"""Each booking comes off on the control-loop message that ends it, as the message reaches the
router (router/cluster/bookings.py), not when the attempt's task reads it: a heartbeat the node
sent after it, handled in between, would count the work twice. Against scripted nodes; each
test hands the router the message and that heartbeat in one turn of its loop."""
from __future__ import annotations

import pytest

from pdwire.control import FirstToken, PrefillRequest, RequestFailed, TokenDelta
from pdwire.messages import Reserved
from router.cluster.registry import NodeLoad
from tests.disagg_harness import Cluster, run, view
from tests.router.test_router_decode_booking import _asked
from tests.router.test_router_kv_move import shipping


def _load(node) -> tuple[int, int, int]:
    """(requests, blocks) booked on the node, and requests its last heartbeat lacks."""
    return node.inflight_requests, node.inflight_blocks, node.unreported_requests


async def _prefilling(c: Cluster):
    """r1 reserved on decode-0 (2 blocks) and sent to prefill-0: (p, d, the output, prefill-0's
    and decode-0's registry entries)."""
    p, d, decode, out, req = await _asked(c, max_tokens=3)
    d.send(Reserved(req.rid, "x1", (3, 4), 0, 2))
    await p.expect(PrefillRequest)
    return p, d, out, c.backend.server.registry.get("prefill-0"), decode


def test_a_prefill_nodes_first_token_releases_its_booking_as_it_arrives():
    """P's FirstToken (its part done), then P's heartbeat showing it idle: nothing of r1 stays
    booked on P, nor is it released a second time once the task reads the token."""
    async def test():
        async with Cluster() as c:
            p, d, out, prefill, _ = await _prefilling(c)
            assert _load(prefill)[:2] == (1, 2)
            c.backend.on_request_message("prefill-0", FirstToken("r1", 11, "a", None, ""))
            c.backend.server.registry.heartbeat("prefill-0", NodeLoad(0, 0, 0.0))
            assert _load(prefill) == (0, 0, 0)
            assert view(await out.next()) == ([([11], "a", None)], False)     # the task read it
            assert _load(prefill) == (0, 0, 0)
            out.task.cancel()
    run(test)


@pytest.mark.parametrize("node_id", ["decode-0", "prefill-0"])
def test_a_nodes_request_failed_releases_its_booking_as_it_arrives(node_id):
    """A node's RequestFailed (the request dropped there, its blocks freed), then its heartbeat
    showing that: nothing of r1 stays booked there before the task reads the failure."""
    async def test():
        async with Cluster() as c:
            p, d, out, prefill, decode = await _prefilling(c)
            node = decode if node_id == "decode-0" else prefill
            c.backend.server.registry.heartbeat(node_id, NodeLoad(1, 0, 2 / 64))     # shows r1
            c.backend.on_request_message(node_id, RequestFailed("r1", "transfer failed: lease_expired", True))
            c.backend.server.registry.heartbeat(node_id, NodeLoad(0, 0, 0.0))
            assert _load(node) == (0, 0, 0)
            out.task.cancel()
    run(test)


def test_the_writers_booking_goes_as_the_receivers_first_delta_arrives():
    """A KV move: D1 (the writer) stays booked until D2's first delta says D2 adopted the blocks;
    that delta releases D1's booking as it arrives, before the task reads it."""
    async def test():
        async with Cluster() as c:
            p, d1, live, out = await shipping(c)
            writer = c.backend.server.registry.get(d1.node_id)
            assert writer.inflight_requests == 1
            c.backend.on_request_message(live.node_id, TokenDelta("r1~1", 0, (13,), 0, "c", None, ""))
            assert writer.inflight_requests == 0
            out.task.cancel()
    run(test)


def test_the_writers_failure_to_ship_releases_its_booking_as_it_arrives():
    """A KV move whose writer D1 cannot ship (RequestFailed for the moved attempt: its hold freed):
    D1's booking comes off as the failure arrives."""
    async def test():
        async with Cluster() as c:
            p, d1, live, out = await shipping(c)
            writer = c.backend.server.registry.get(d1.node_id)
            assert writer.inflight_requests == 1
            c.backend.on_request_message(d1.node_id, RequestFailed("r1~1", "cannot reach the decode node", True))
            assert writer.inflight_requests == 0
            out.task.cancel()
    run(test)
