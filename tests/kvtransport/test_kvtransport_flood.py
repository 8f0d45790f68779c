"""A flood from an authenticated peer against the receiving node's loop: one poll takes messages
for max_poll_s at most (in the link's own clock, made to tick per call here), and of a message
longer than any (MAX_MESSAGE_FRAMES) the receiver takes one frame more than that, counts it
dropped and skips the rest, over as many polls as it takes, serving the others meanwhile; so does
a sender of a reply longer than any (MAX_REPLY_FRAMES)."""
import time
from collections import Counter

import pytest
import zmq

import kvtransport.zmq_link as zmq_link
from kvtransport.events import TransferCommitted
from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_link import MAX_MESSAGE_FRAMES
from kvtransport.zmq_send_link import MAX_REPLY_FRAMES, MAX_SKIP_FRAMES
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmtp_auth import plain_client
from tests.kvtransport.test_kvtransport_zmq import DST_IDS, GEOM, HANG_S, NUM_TOKENS, SRC_IDS, _connect, _pair, _until

pytestmark = pytest.mark.timeout(300)


class TickingClock:
    """zmq_link's `time`, whose monotonic() moves `step` seconds at every call."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step
        self.perf_counter, self.sleep = zmq_link.time.perf_counter, zmq_link.time.sleep

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


def test_a_flood_of_small_messages_cannot_hold_one_poll_past_its_time(monkeypatch):
    """2,000 small messages from a PLAIN-authenticated connection: each poll of a receiver with
    max_poll_s 10 ms takes 11 at most when its clock moves 1 ms a call (the byte budget alone
    would take all 2,000 in one), and polls after it take the rest, each counted once."""
    dst = make_pool(seed=None, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, max_poll_s=0.010)
    ctx = zmq.Context(io_threads=1)
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    plain_client(flood, TEST_SECRET)
    flood.connect(recv.endpoint)
    try:
        for _ in range(2000):
            flood.send(b"x" * 8)
        monkeypatch.setattr(zmq_link, "time", TickingClock(0.001))
        per_poll, drops, deadline = [], 0, time.monotonic() + HANG_S
        while drops < 2000 and time.monotonic() < deadline:
            recv.poll(0)
            per_poll.append(recv.metrics.frames_dropped - drops)
            drops += per_poll[-1]
        assert drops == 2000 and max(per_poll) <= 11
    finally:
        flood.close()
        ctx.term()
        recv.close()


def test_a_message_longer_than_any_is_skipped_without_being_held(monkeypatch):
    """A paired sender's message of 20,000 frames: the receiver hands MAX_MESSAGE_FRAMES + 1 of
    them to its handler (dropped once, MALFORMED), skips the rest over several polls (100 frames a
    poll here), and then commits that sender's transfer bit-exactly."""
    src, dst, recv, send = _pair("tcp")
    seen, handle = [], recv._link._handle
    recv._link._handle = lambda peer, frames: (seen.append(len(frames)), handle(peer, frames))
    try:
        _connect(send, recv)
        seen.clear()                            # the handshake's
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        send._link.send(recv.endpoint, [b"y"] * 20_000)
        monkeypatch.setattr(zmq_link, "time", TickingClock(1e-5))
        recv._link._max_poll_s = 1e-3
        skipping_polls, deadline = 0, time.monotonic() + HANG_S
        while (recv.metrics.frames_dropped == 0 or recv._link._skipping is not None) and time.monotonic() < deadline:
            recv.poll(0)
            skipping_polls += recv._link._skipping is not None
        assert skipping_polls >= 2 and seen == [MAX_MESSAGE_FRAMES + 1]
        assert recv.metrics.drops == Counter({DropReason.MALFORMED: 1})
        monkeypatch.undo()
        send.send_blocks("x1", [1, 2, 3, 4, 5], list(DST_IDS[1:]), src, list(SRC_IDS[1:]))
        send.commit("x1", 7, NUM_TOKENS)
        events = _until(recv, lambda: recv.metrics.transfers_committed == 1)
        assert [type(e) for e in events] == [TransferCommitted]
        assert all(same_bytes(dst[d], src[s]) for d, s in zip(DST_IDS[1:], SRC_IDS[1:]))
        assert recv.metrics.drops == Counter({DropReason.MALFORMED: 1})
    finally:
        send.close()
        recv.close()


def test_a_reply_longer_than_any_is_skipped_by_the_sender():
    """A receiver's reply of 20,000 frames: the sender's poll hands none of it on (it reads
    MAX_REPLY_FRAMES of it, counts it dropped once) and skips the rest MAX_SKIP_FRAMES a poll at
    most, over several polls; then it serves on: a transfer commits."""
    src, dst, recv, send = _pair("tcp")
    ep = recv.endpoint
    seen, handle = [], send._core.handle
    send._core.handle = lambda endpoint, frames: (seen.append(len(frames)), handle(endpoint, frames))
    try:
        _connect(send, recv)
        (peer,) = recv._core._sessions
        recv._link.send(peer, [b"z"] * 20_000)
        deadline = time.monotonic() + HANG_S
        while not send._link._socks[ep].poll(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        skipping_polls = 0
        while (skipping_polls == 0 or ep in send._link._skipping) and time.monotonic() < deadline:
            assert send.poll(0) == []
            skipping_polls += 1
        assert skipping_polls >= 20_000 // MAX_SKIP_FRAMES and not send._link._socks[ep].poll(0)
        assert send.metrics.drops == Counter({DropReason.MALFORMED: 1})
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", ep)
        send.send_blocks("x1", [1, 2, 3, 4, 5], list(DST_IDS[1:]), src, list(SRC_IDS[1:]))
        send.commit("x1", 7, NUM_TOKENS)
        _until(recv, lambda: recv.metrics.transfers_committed == 1)
        assert all(n <= MAX_REPLY_FRAMES for n in seen)
    finally:
        send.close()
        recv.close()
