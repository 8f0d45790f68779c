"""The simulated router ranks decode nodes on what the real one knows (pdplan/load_view.py: the
last heartbeat plus its bookings since) and breaks ties with the same coin (routing_cost.py)."""
from __future__ import annotations

import random
from dataclasses import fields
from types import SimpleNamespace

from node_shell.config import NodeConfig
from pdplan.events import EventLoop
from pdplan.load_view import HEARTBEAT_S, LoadView
from pdplan.simulation import Topology, simulate
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
    view.book(5)
    assert (view.used_blocks, view.sequences) == (5, 1)
    engine.pool.used = 9
    loop.run(0.25)
    assert (view.used_blocks, view.sequences) == (9, 1)
    engine.running, engine.load, engine.pool.used = [], lambda: 0, 0
    view.release(5)
    assert (view.used_blocks, view.sequences) == (4, 0)
    loop.run(0.75)
    assert (view.used_blocks, view.sequences) == (0, 0)
    loop.run()
    assert loop.now == 0.7                          # no beat after the one that showed it idle


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
