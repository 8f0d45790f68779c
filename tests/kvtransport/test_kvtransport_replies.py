"""The sender's side of the ZMQ link: what the decode nodes reply. A reply dropped for its length is
told apart from an empty one and counted; the decode nodes' replies are served in turn; a reply
frame above MAX_REPLY_BYTES disconnects its receiver (libzmq's MAXMSGSIZE)."""
import time
from collections import Counter

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransport.link import Dropped
from kvtransport.metrics import DropReason
from kvtransport.testing import TEST_SECRET
from kvtransport.zmq_link import ZmqReceiveLink
from kvtransport.zmq_send_link import MAX_REPLY_BYTES, MAX_REPLY_FRAMES, ZmqSendLink
from tests.kvtransport.test_kvtransport_zmq import HANG_S, _connect, _pair

pytestmark = pytest.mark.timeout(300)


class Links:
    """A send link connected to n receive links, each of which knows its connection (peers[k])."""

    def __init__(self, n: int, max_poll_s: float = 0.02) -> None:
        self.send = ZmqSendLink("p0", TEST_SECRET, max_poll_s=max_poll_s)
        self.recvs = [ZmqReceiveLink(TEST_SECRET) for _ in range(n)]
        self.peers = [self._peer_of(recv) for recv in self.recvs]

    def _peer_of(self, recv: ZmqReceiveLink) -> str:
        seen = []
        recv.bind(lambda peer, frames: seen.append(peer))
        self.send.open(recv.endpoint)
        self.send.paired(recv.endpoint)
        self.send.send(recv.endpoint, [b"hi"])
        deadline = time.monotonic() + HANG_S
        while not seen and time.monotonic() < deadline:
            recv.receive(0.05)
        return seen[0]

    def wait_readable(self, recv: ZmqReceiveLink) -> None:
        assert self.send._socks[recv.endpoint].poll(int(HANG_S * 1000), zmq.POLLIN)

    def close(self) -> None:
        for recv in self.recvs:
            self.send.close(recv.endpoint)
            recv.close()
        self.send.shutdown()


def _never(endpoint, drop):
    raise AssertionError(f"{endpoint} dropped {drop}")


def test_a_dropped_reply_is_told_apart_from_an_empty_one():
    """A reply of more frames than any is Dropped (MALFORMED), an empty frame is a reply: the
    send link's recv hands back each as what it is, the dropped one's frames all skipped."""
    links = Links(1)
    recv, peer = links.recvs[0], links.peers[0]
    try:
        recv.send(peer, [b"x"] * (MAX_REPLY_FRAMES + 1))
        recv.send(peer, [b""])
        first = links.send.recv(recv.endpoint, HANG_S)
        assert type(first) is Dropped and first.reason is DropReason.MALFORMED
        assert links.send.recv(recv.endpoint, HANG_S) == [b""]
    finally:
        links.close()


def test_a_reply_dropped_while_pairing_is_counted_and_the_pairing_goes_on():
    """An over-long message ahead of the receiver's challenge: the sender counts it (MALFORMED,
    in its metrics and its heartbeat's counters), waits for the next, and pairs."""
    _, _, recv, send = _pair("tcp")
    link, reply = recv._link, recv._core._send
    junk = []

    def junk_first(peer, frames):
        if not junk:
            link.send(peer, [b"j"] * (MAX_REPLY_FRAMES + 1))
            junk.append(peer)
        reply(peer, frames)

    recv._core._send = junk_first
    try:
        assert _connect(send, recv).node_id == "d0" and junk
        assert send.metrics.drops == Counter({DropReason.MALFORMED: 1})
        assert send.metrics.counters().frames_dropped == 1
    finally:
        send.close()
        recv.close()


def test_replies_are_served_in_turn_across_decode_nodes():
    """With a receive() of one reply (max_poll_s 0), a decode node with three replies waiting and
    one with one: the calls take them in turn (a, b, a, a), not a's three first."""
    links = Links(2, max_poll_s=0.0)
    (a, b), (peer_a, peer_b) = links.recvs, links.peers
    try:
        for _ in range(3):
            a.send(peer_a, [b"a"])
        b.send(peer_b, [b"b"])
        links.wait_readable(a)
        links.wait_readable(b)
        served, deadline = [], time.monotonic() + HANG_S
        while len(served) < 4 and time.monotonic() < deadline:
            links.send.receive(0.05, lambda endpoint, frames: served.append(bytes(frames[0])), _never)
        assert served == [b"a", b"b", b"a", b"a"]
    finally:
        links.close()


def test_a_reply_frame_over_the_cap_disconnects_its_receiver():
    """A reply frame of MAX_REPLY_BYTES is taken; one byte more and libzmq drops the connection
    (the sender's DEALER has MAXMSGSIZE) before the frame reaches anyone."""
    links = Links(1)
    recv, peer = links.recvs[0], links.peers[0]
    sock = links.send._socks[recv.endpoint]
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        recv.send(peer, [b"h" * MAX_REPLY_BYTES])
        assert links.send.recv(recv.endpoint, HANG_S) == [b"h" * MAX_REPLY_BYTES]
        recv.send(peer, [b"x" * (MAX_REPLY_BYTES + 1)])
        assert monitor.poll(int(HANG_S * 1000)), "the connection was not dropped"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert links.send.recv(recv.endpoint, 0.0) is None
    finally:
        sock.disable_monitor()
        monitor.close()
        links.close()
