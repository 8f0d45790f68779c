"""The simulated router ranks decode nodes on what the real one knows (pdplan/load_view.py: the
last heartbeat plus its bookings since) and breaks ties with the same coin (routing_cost.py)."""
from __future__ import annotations

import random
from dataclasses import fields
from types import SimpleNamespace

import pytest

from node_shell.config import NodeConfig
from pdplan.decode_pool import DecodePool
from pdplan.events import EventLoop
from pdplan.load_view import HEARTBEAT_S, LoadView
from pdplan.simulation import Topology, simulate
from router.cluster.registry import NodeLoad, NodeRegistry, NodeRole
from tests.planner.test_simulator import profile, request, tokens


def test_the_heartbeat_period_is_the_nodes():
    """The view's heartbeat is the one a node sends (NodeConfig.heartbeat_s)."""
    assert HEARTBEAT_S == next(f.default for f in fields(NodeConfig) if f.name == "heartbeat_s")


def _engine(used: int, running: int):
    return SimpleNamespace(pool=SimpleNamespace(used=used), running=[0] * running, waiting=[], reserved={},
                           load=lambda: running)


def test_bookings_count_until_the_next_heartbeat_then_the_nodes_own_figures():
    """A booking of 5 blocks shows at once (0 + 5); the node grows to 9 blocks, unseen until its
    heartbeat at the phase (0.2 s); a release then takes off the prompt's 5 blocks only (9 - 5 = 4)
    until the next heartbeat shows the node as it is (idle: 0), after which the beats stop."""
    loop = EventLoop()
    engine = _engine(0, 0)
    view = LoadView(engine, loop, phase=0.2)
    engine.running, engine.load = [0], lambda: 1
    view.book(1, 5)
    assert (view.used_blocks, view.sequences) == (5, 1)
    engine.pool.used = 9
    loop.run(0.25)
    assert (view.used_blocks, view.sequences) == (9, 1)
    engine.running, engine.load, engine.pool.used = [], lambda: 0, 0
    view.release(1)
    assert (view.used_blocks, view.sequences) == (4, 0)
    loop.run(0.75)
    assert (view.used_blocks, view.sequences) == (0, 0)
    loop.run()
    assert loop.now == 0.7                          # no beat after the one that showed it idle


def test_a_release_takes_off_what_its_booking_counted():
    """Bookings of 1 block (a prompt whose other blocks the node holds) and of 9 (none held): each
    release takes off its own booking's blocks, as the router's (registry.py Booking), and an
    unknown request's release is an error."""
    view = LoadView(_engine(0, 0), EventLoop(), phase=0.2)
    view.book(1, 1), view.book(2, 9)
    assert (view.used_blocks, view.sequences) == (10, 2)
    view.release(2)
    assert (view.used_blocks, view.sequences) == (1, 1)
    view.release(1)
    assert (view.used_blocks, view.sequences) == (0, 0)
    with pytest.raises(KeyError):
        view.release(1)


def test_the_view_counts_a_sequence_of_bookings_as_the_routers_registry_does():
    """The same bookings, heartbeats and releases on the router's registry (each booking taken at
    once, as a simulated reservation is) and on a LoadView leave the same sequences, blocks and
    queued prefill blocks unreported after every step: a local prefill's blocks come off at its
    release or at the first heartbeat after it, once, and a remote one's are never queued."""
    loop = EventLoop()
    view = LoadView(_engine(0, 1), loop, phase=0.2)       # never idle: the heartbeats go on
    reg = NodeRegistry(60.0)
    node = reg.register("d", NodeRole.DECODE, "tcp://d")
    bookings, beats = {}, 0
    script = [("book", 1, 3, 3), ("book", 2, 9, 0), ("beat",), ("release", 1), ("book", 3, 2, 2),
              ("book", 4, 1, 1), ("release", 4), ("beat",), ("release", 3), ("book", 5, 4, 4), ("release", 2),
              ("beat",), ("release", 5)]
    for op, *args in script:
        if op == "book":
            rid, blocks, prefill = args
            view.book(rid, blocks, prefill)
            bookings[rid] = reg.book("d", blocks, prefill)
            reg.taken(bookings[rid])
        elif op == "release":
            view.release(args[0])
            reg.release(bookings.pop(args[0]))
        else:
            loop.run(0.2 + HEARTBEAT_S * beats + HEARTBEAT_S / 2)
            beats += 1
            reg.heartbeat("d", NodeLoad(1))
        assert (view.since_seqs, view.since_blocks, view.queued_blocks) == \
            (node.unreported_requests, node.unreported_blocks, node.unreported_prefill_blocks), (op, *args)
    assert (view.queued_blocks, loop.now) == (0, 0.2 + HEARTBEAT_S * 2)


def test_a_simulated_burst_on_a_document_both_nodes_hold_spreads_by_their_queued_prefills():
    """As the router's (tests/router/test_router_kv_routing.py): both nodes hold a 200-block
    document that no request uses, decode-1's heartbeat shows 3 blocks in use; 4 questions of 24
    tokens (2 blocks past the document, each prefilled on its decode node) within one heartbeat
    book 2 queued blocks each and the blocks their node takes: 202 for the first on a node (the
    document's idle blocks too), 2 after. decode-0 costs 2, then 2 + 2 + 202 = 206 and 210;
    decode-1 5, then 2 + 2 + 205 = 209: they alternate."""
    pool = DecodePool(2, profile(num_blocks=4096), EventLoop(), lambda: None)
    doc = tokens(3200)
    reqs = [request(i, doc + tokens(24, 10_000 + 24 * i), 40) for i in range(4)]
    for node in pool.nodes:
        for h in reqs[0].block_hashes[:200]:
            node.engine.pool.cached[h] = None
    pool.nodes[1].view.beat_used = 3
    assert [pool.reserve(r)[0].engine.name for r in reqs] == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert [n.view.queued_blocks for n in pool.nodes] == [4, 4]
    assert [n.view.used_blocks for n in pool.nodes] == [204, 207]


def test_the_view_counts_the_unused_cached_blocks_a_reservation_takes():
    """As the router's (tests/router/test_router_decode_booking.py): one node holds 6 documents of
    10 blocks that no request uses (free to take); a question on each takes 11 blocks (1 new, 10
    cached), and the view counts 66, the blocks in use on the node, not 6."""
    pool = DecodePool(1, profile(num_blocks=200), EventLoop(), lambda: None)
    reqs = [request(i, tokens(160, 1000 * (i + 1)) + tokens(8, 500), 4) for i in range(6)]
    for r in reqs:
        for h in r.block_hashes[:10]:
            pool.nodes[0].engine.pool.cached[h] = None
    assert [pool.reserve(r)[1] for r in reqs] == [10] * 6
    assert pool.nodes[0].view.used_blocks == pool.nodes[0].engine.pool.used == 66


def test_a_tie_goes_where_the_routers_coin_sends_it_after_the_requests_ranked_before():
    """One prompt on two empty nodes (equal cost): the router's RoutingCost(seed 0) draws a coin per
    node per ranking, so after k earlier rankings the lower of draws 2k and 2k+1 wins; the simulated
    router, told k, sends it to the same node, for each k."""
    rng = random.Random(0)
    draws = [rng.random() for _ in range(20)]
    assert {draws[2 * k] < draws[2 * k + 1] for k in range(10)} == {True, False}     # both nodes get some
    for k in range(10):
        req = request(0, tokens(40), 4)
        simulate(profile(), [req], Topology.disaggregated(1, 2), ranked_before=k)
        assert req.decode_node == ("decode-0" if draws[2 * k] < draws[2 * k + 1] else "decode-1")


def test_the_coin_is_drawn_in_the_routers_node_order_which_sorts_names_as_text():
    """Twelve empty nodes (equal cost): the router's registry lists them by id as text (decode-0,
    decode-1, decode-10, decode-11, decode-2, ...) and draws one coin each in that order; the lowest
    wins. The simulated router sends the prompt to the same node after each k earlier rankings, and
    for some k that is not the node drawn in numeric order (decode-10 is not the third)."""
    names = [f"decode-{i}" for i in range(12)]
    routers, numeric = [], []
    for k in range(8):
        rng = random.Random(0)
        for _ in range(12 * k):
            rng.random()
        draws = [rng.random() for _ in names]
        routers.append(min(zip(draws, sorted(names)))[1])
        numeric.append(min(zip(draws, names))[1])
        req = request(0, tokens(40), 4)
        simulate(profile(), [req], Topology.disaggregated(1, 12), ranked_before=k)
        assert req.decode_node == routers[-1]
    assert routers != numeric
