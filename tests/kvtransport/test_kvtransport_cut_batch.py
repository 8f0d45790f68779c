"""A split batch cut by a send timeout: the receiver is lost with every transfer whose messages
had not left, committed ones included, so that their requests fail at once instead of their
reservations waiting for their lease."""
import time

import pytest

from kvtransport.base import TransportError
from kvtransport.events import FailReason
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender
from tests.kvtransport.queue_probe import small_kernel_buffers
from tests.kvtransport.test_kvtransport_split_queue import BIG, BIG_NBYTES
from tests.kvtransport.test_kvtransport_zmq import HANG_S, _connect

pytestmark = pytest.mark.timeout(300)


def test_a_cut_batch_fails_the_transfer_committed_behind_it(monkeypatch):
    """Nobody polls the receiver. Transfer a's first 130 blocks fill its queue (4 blocks), both
    kernel buffers (kept small) and part of the sender's (260 messages); transfer b's two blocks
    and its Commit queue behind them; a's next blocks are cut by the send timeout. The sender then
    reports b failed with a (its Commit never left: the lost connection is closed with it), once,
    and every payload of both counts as sent once that connection is closed (pins may go)."""
    small_kernel_buffers(monkeypatch)
    src, dst = make_pool(seed=1, **BIG), make_pool(seed=None, **BIG)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, max_queue_bytes=4 * BIG_NBYTES)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, hwm=4, send_timeout=1.0)
    ep = recv.endpoint
    try:
        _connect(send, recv)
        recv.register(Reservation("a", tuple(range(600))))
        recv.register(Reservation("b", (600, 601)))
        send.begin("a", ep)
        send.begin("b", ep)
        first = list(range(130))
        send.send_blocks("a", first, first, src, first)
        send.send_blocks("b", [0, 1], [600, 601], src, [0, 1])
        send.commit("b", 7, 2 * BIG["block_size"])
        rest = list(range(130, 600))
        with pytest.raises(TransportError, match="not draining"):
            send.send_blocks("a", rest, rest, src, rest)
        failed = send.poll(0)
        assert sorted((e.xfer_id, e.reason) for e in failed) == [("a", FailReason.PEER_DEAD), ("b", FailReason.PEER_DEAD)]
        deadline = time.monotonic() + HANG_S
        while not (send.is_sent("a") and send.is_sent("b")) and time.monotonic() < deadline:
            assert send.poll(0.01) == []
        assert send.is_sent("a") and send.is_sent("b") and ep not in send._link.endpoints()
    finally:
        send.close()
        recv.close()


def test_a_commit_that_left_is_not_failed_when_its_receiver_is_lost_later():
    """A transfer whose Commit left before its receiver was lost (here: the receiver closed, the
    sender's heartbeats unanswered) stays done: only the open one fails."""
    src, dst = make_pool(seed=1, **BIG), make_pool(seed=None, **BIG)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, peer_timeout=0.5, heartbeat_interval=0.1)
    ep = recv.endpoint
    try:
        _connect(send, recv)
        recv.register(Reservation("a", (0, 1)))
        recv.register(Reservation("b", (2, 3)))
        send.begin("a", ep)
        send.begin("b", ep)
        send.send_blocks("b", [0, 1], [2, 3], src, [0, 1])
        send.commit("b", 7, 2 * BIG["block_size"])
        deadline = time.monotonic() + HANG_S
        while not recv.metrics.transfers_committed and time.monotonic() < deadline:
            recv.poll(0.01)
        assert recv.metrics.transfers_committed == 1
        recv.close()
        recv = None
        events, deadline = [], time.monotonic() + HANG_S
        while not events and time.monotonic() < deadline:
            events += send.poll(0.05)
        assert [(e.xfer_id, e.reason) for e in events] == [("a", FailReason.PEER_DEAD)]
        assert send.poll(0) == []
    finally:
        send.close()
        if recv is not None:
            recv.close()
