"""waitables(): the sockets a node's loop sleeps on (node_shell/runtime.py). One loop that waits
only on them, then polls with no wait, pairs a ZmqSender with a ZmqReceiver and moves a transfer
bit-exactly: every reply and every frame turns one of them readable."""
from __future__ import annotations

import zmq

from kvtransport.events import TransferCommitted
from kvtransport.fake import FakeNetwork, FakeReceiver
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool
from tests.kvtransport.test_kvtransport_zmq import DST_IDS, HANG_S, NUM_TOKENS, _pair, _ship, _written_exactly


def _sleep_on(*sides) -> None:
    """Wait (in the kernel) until a socket of sides has input; fails if none does within HANG_S."""
    sockets = [s for side in sides for s in side.waitables()]
    assert zmq.zmq_poll([(s, zmq.POLLIN) for s in sockets], int(HANG_S * 1000)), "no socket woke the wait"


def test_a_loop_sleeping_on_both_sides_sockets_pairs_and_moves_a_transfer():
    """Pairing steps and blocks go on only after a wait on waitables() (never a timeout): the pair
    forms, the Commit lands, the blocks are bit-exact."""
    src, dst, recv, send = _pair("tcp")
    before = dst.clone()
    try:
        assert send.try_connect(recv.endpoint) is None          # the hello left
        while send.try_connect(recv.endpoint) is None:
            _sleep_on(recv, send)
            recv.poll(0.0)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        _ship(send, src)
        events = []
        while not events:
            _sleep_on(recv)
            events += recv.poll(0.0)
        assert [type(e) for e in events] == [TransferCommitted] and events[0].num_tokens == NUM_TOKENS
        assert _written_exactly(dst, before, src)
    finally:
        send.close()
        recv.close()


def test_a_backend_without_sockets_offers_none():
    """The fake receiver has no socket to wait on: its caller polls."""
    pool = make_pool()
    recv = FakeReceiver(FakeNetwork(), "d0", pool, make_identity(pool, "d0"), TEST_SECRET)
    assert recv.waitables() == []
