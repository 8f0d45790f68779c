"""The simulated router admits a request as router/cluster/admission.py does: on the room its view
of a decode node shows (the last heartbeat's free blocks less the bookings since: load_view.py),
not on the node's state this instant; the node's own check has the last word."""
from __future__ import annotations

import random

import pytest

from pdplan.load_view import HEARTBEAT_S
from pdplan.sim_router import FIRST_WAIT_S
from pdplan.simulation import Topology, simulate
from tests.planner.test_simulator import STEP, profile, request, tokens

PREFILL_600 = STEP.of([(512, 0)]) + STEP.of([(88, 512)])     # at the test profile's 512-token budget


def _after_a_grown_request(lead: float):
    """A 16-token prompt that grows to 31 blocks on the one decode node (64 blocks), then a 600-token
    prompt with 40 tokens to come (40 blocks), `lead` s before the first heartbeat after the first
    one ends (or `lead` s after it ends, when lead < 0): (first, second, heartbeat time)."""
    alone = request(0, tokens(16), 480)
    simulate(profile(num_blocks=64), [alone], Topology.disaggregated(1, 1))
    end = alone.token_times[-1]
    phase = random.Random(0).uniform(0, HEARTBEAT_S)     # decode-0's (decode_pool.py)
    beat = phase + (int((end - phase) // HEARTBEAT_S) + 1) * HEARTBEAT_S
    at = beat - min(lead, (beat - end) / 2) if lead > 0 else end - lead
    reqs = [request(0, tokens(16), 480), request(1, tokens(600, 10_000), 40, at=at)]
    simulate(profile(num_blocks=64), reqs, Topology.disaggregated(1, 1))
    assert reqs[0].token_times[-1] == pytest.approx(end)
    return reqs[0], reqs[1], beat


def test_a_request_waits_for_the_heartbeat_that_shows_the_room_a_finished_request_left():
    """The first request's release takes off its 1 prompt block only: the view shows 30 of 64 blocks
    in use until the node's next heartbeat, though the node holds none. The second prompt (40
    blocks) arriving just before that heartbeat waits for it, and is prefilled from then on."""
    _, second, beat = _after_a_grown_request(0.02)
    assert beat - second.arrival < FIRST_WAIT_S
    assert second.ttft == pytest.approx(beat - second.arrival + PREFILL_600)


def test_when_the_timer_fires_first_the_router_asks_the_node_anyway():
    """The same prompt arriving 1 ms after the first request ends, the heartbeat further off than
    the router's first timer (50 ms): the timer asks the first ranked node whatever the view says,
    and the node, having room, reserves."""
    _, second, beat = _after_a_grown_request(-0.001)
    assert beat - second.arrival > FIRST_WAIT_S
    assert second.ttft == pytest.approx(FIRST_WAIT_S + PREFILL_600)


def test_a_node_that_says_busy_is_skipped_and_the_router_asks_the_next_its_view_shows_room_on():
    """decode-0 is truly full (a 50-block reservation its view has not seen yet), decode-1 truly
    empty but booked 30 blocks by the view: decode-0 ranks first and has room by the view, answers
    Busy, and the next ask goes to decode-1. With decode-1 booked past its room (60 of 64), none is
    left to ask; the timer's probe asks the first ranked one anyway (decode-0: Busy again)."""
    from pdplan.decode_pool import DecodePool
    from pdplan.events import EventLoop
    from pdplan.sim_engine import SimSeq
    for booked, expected in ((30, "decode-1"), (60, None)):
        loop = EventLoop()
        pool = DecodePool(2, profile(num_blocks=64), loop, lambda: None)
        hog = request(99, tokens(800, 50_000), 0)
        assert pool.nodes[0].engine.reserve(SimSeq(hog, 800, 1), 0) == (0, 50)  # 50 blocks, unseen
        pool.nodes[1].view.since_blocks = booked
        req = request(1, tokens(320, 90_000), 16)
        got = pool.reserve(req)
        assert (got[0].engine.name if got else None) == expected
        if expected is None:
            assert pool._refused[1] == {"decode-0": 64}
            assert pool.reserve(req, probe=True) is None and req.decode_node == ""
        else:
            assert req.decode_node == "decode-1" and 1 not in pool._refused


def test_a_waiting_request_is_woken_at_a_later_heartbeat_even_at_a_heartbeats_instant():
    """Woken at a heartbeat's instant (phase + k x period, as the view computes it), a request that
    still finds no room is woken again at a later instant, never at the same one (a planner search
    once spun forever there: now - phase rounded below k periods)."""
    from pdplan.decode_pool import DecodePool
    from pdplan.events import EventLoop
    loop = EventLoop()
    pool = DecodePool(3, profile(), loop, lambda: None)
    for k in range(1, 400):
        for node in pool.nodes:
            loop.now = node.view.phase + k * node.view.period
            pool._wakes.clear()
            before = len(loop._heap)
            pool._wake_at_heartbeats()
            assert all(t > loop.now for t, _, _ in loop._heap[before:])
            loop._heap.clear()
