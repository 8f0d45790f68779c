"""A sender with more open transfers to one decode node than a Heartbeat names
(MAX_HEARTBEAT_XFERS) names them over several; each tick starts a chunk further on, so a send
queue with room for one message a tick still keeps every transfer's lease alive."""
from __future__ import annotations

from kvtransport.fake import FakeNetwork, FakeReceiver, FakeSender, ManualClock
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool
from pdwire.messages import MAX_HEARTBEAT_XFERS


def test_one_free_slot_a_tick_still_names_every_open_transfer():
    """257 transfers with 5 s leases, 30 ticks of 1 s, one heartbeat message let out a tick (the
    rest dropped, as try_send drops on a full queue): none lapses (the 257th did: every tick sent
    the same first chunk)."""
    clock = ManualClock()
    net = FakeNetwork(clock)
    src, dst = make_pool(seed=1), make_pool(seed=2)
    recv = FakeReceiver(net, "d0", dst, make_identity(dst, "d0"), TEST_SECRET, 10.0)
    send = FakeSender(net, make_identity(src, "p0"), TEST_SECRET, heartbeat_interval=1.0, peer_timeout=10.0)
    xfers = [f"h{k}" for k in range(MAX_HEARTBEAT_XFERS + 1)]
    send.connect(recv.endpoint)
    for k, xfer_id in enumerate(xfers):
        recv.register(Reservation(xfer_id, (k % dst.shape[0],), cached_prefix_blocks=1, lease_s=5.0))
        send.begin(xfer_id, recv.endpoint)
    real, budget = send._link.try_send, [0]

    def one_slot(endpoint, frames):
        if budget[0] > 0:
            budget[0] -= 1
            real(endpoint, frames)
    send._link.try_send = one_slot
    events = []
    for _ in range(30):
        clock.advance(1.0)
        budget[0] = 1
        events += send.poll() + recv.poll()
    assert events == [] and set(recv.ledger.live_xfers()) == set(xfers)
