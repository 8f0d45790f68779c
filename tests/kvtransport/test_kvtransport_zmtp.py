"""ZMTP PLAIN on the KV receiver: a local process without the cluster secret is refused at
ZeroMQ's handshake, so none of its (huge) messages is ever buffered, while real senders are served."""
import socket
import threading
import time

import pytest
from zmq.auth.thread import AuthenticationThread

from kvtransport.events import TransferCommitted
from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from kvtransport.state import TransferState
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender
from kvtransport.zmtp_auth import HANDSHAKE_MS, plain_password
from tests.kvtransport.test_kvtransport_zmq import HANG_S, _until
from tests.zmtp_flood import MIB, bare_router, flood, rss

pytestmark = pytest.mark.timeout(600)

# one block = 2 * 4 layers * 16 tokens * 16 heads * 128 dims * 4 bytes = 1 MiB: a flood frame of
# 1 MiB is under the receiver's MAXMSGSIZE, so only the handshake keeps it out
GEOM = dict(num_blocks=4, num_layers=4, block_size=16, num_kv_heads=16, head_dim=128)
ROUNDS = 4                      # messages of 64 frames of 1 MiB per flood: 256 MiB
BOUND = 24 * MIB                # what the receiver may grow by while a flood is refused


def _receiver():
    dst = make_pool(seed=2, **GEOM)
    return dst, ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)


def _ship_one(recv, dst):
    """An authenticated sender pairs and ships block 1 -> 2; the transfer commits bit-exactly."""
    src = make_pool(seed=1, **GEOM)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET)
    try:
        out = []
        t = threading.Thread(target=lambda: out.append(send.connect(recv.endpoint, HANG_S)))
        t.start()
        while t.is_alive():
            recv.poll(0.02)
        assert out and out[0].node_id == "d0"
        recv.register(Reservation("x1", (2,)))
        send.begin("x1", recv.endpoint)
        send.send_block("x1", 0, 2, src, 1)
        send.commit("x1", 7, 16)
        events = _until(recv, lambda: recv.ledger.state("x1") is TransferState.COMMITTED)
        assert [type(e) for e in events] == [TransferCommitted] and events[0].xfer_id == "x1"
        assert same_bytes(dst[2], src[1])
    finally:
        send.close()


def test_a_flood_without_the_password_is_refused_before_it_is_buffered():
    """256 MiB in 64-frame messages from a wrong PLAIN password and 128 MiB from a peer with no
    mechanism grow the receiver by less than BOUND, deliver nothing, are counted as zmtp_refused,
    and a real sender on the same socket is served bit-exactly afterwards."""
    dst, recv = _receiver()
    try:
        before = rss()
        with flood(recv.endpoint, "0" * 64, ROUNDS), flood(recv.endpoint, None, ROUNDS // 2):
            _until(recv, lambda: recv.metrics.drops[DropReason.ZMTP_REFUSED] >= ROUNDS)
            time.sleep(0.5)                               # what libzmq would read, it has read now
            recv.poll(0.1)
            grown = rss() - before
        assert grown < BOUND, f"the receiver grew {grown / MIB:.0f} MiB"
        assert set(recv.metrics.drops) == {DropReason.ZMTP_REFUSED}   # no frame of theirs was read
        _ship_one(recv, dst)
        assert set(recv.metrics.drops) == {DropReason.ZMTP_REFUSED}
    finally:
        recv.close()


def test_the_same_flood_fills_a_router_socket_without_zmtp_auth():
    """The control for the bound above: a ROUTER with the receiver's options but no ZMTP PLAIN
    buffers a flood's whole messages before anyone reads them (the hole this closes). The ROUTER
    lives in a process of its own: this one's RSS moves with what earlier tests free."""
    with bare_router(MIB + 64) as (endpoint, pid):
        before = rss(pid)
        with flood(endpoint, None, 2):
            deadline = time.monotonic() + HANG_S          # only bounds a hang: libzmq reads on
            while (grown := rss(pid) - before) <= 96 * MIB and time.monotonic() < deadline:
                time.sleep(0.05)
        assert grown > 96 * MIB, f"the unguarded socket grew only {grown / MIB:.0f} MiB"


def test_the_password_proves_the_secret_without_revealing_it():
    """The PLAIN password is 64 hex digits, differs from the secret and from another secret's."""
    password = plain_password(TEST_SECRET)
    assert len(password) == 64 and int(password, 16) >= 0
    assert TEST_SECRET.hex() not in password and TEST_SECRET.decode() not in password
    assert password != plain_password(b"another-cluster-secret-0123456789")


def test_closing_the_receiver_stops_its_zap_thread():
    """Every receiver's ZAP handler thread ends with its close(): none is left behind."""
    def zap_threads():
        return [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)]
    already = zap_threads()
    receivers = [_receiver()[1] for _ in range(3)]
    assert len(zap_threads()) == len(already) + 3
    for recv in receivers:
        recv.close()
    assert zap_threads() == already


def test_a_connection_that_never_finishes_the_handshake_is_closed():
    """A TCP connection that sends nothing is closed within HANDSHAKE_MS (libzmq's default, 30 s,
    let silent connections pile up: 472 of them took a router limited to 400 fds off HTTP, and
    its I/O thread spun on the refused accepts)."""
    dst, recv = _receiver()
    try:
        host, port = recv.endpoint.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.settimeout(HANDSHAKE_MS / 1000 + 5)
        start = time.monotonic()
        try:
            while sock.recv(4096):      # libzmq's greeting, then the close
                pass
        except ConnectionResetError:
            pass
        assert time.monotonic() - start < HANDSHAKE_MS / 1000 + 5
        sock.close()
    finally:
        recv.close()

