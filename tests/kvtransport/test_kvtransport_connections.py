"""A session on the KV receiver is bound to the ZMQ connection that opened it, not to the routing
id the peer chose: a local process that sniffed the PLAIN password, a routing id and a sealed
message cannot replay that message, with payload bytes of its own, on a connection of its own."""
import os
import time

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransport.events import TransferCommitted
from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from kvtransport.session import AuthKind, auth_frame
from kvtransport.state import TransferState
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmtp_auth import ThreadGuard, connection_name, plain_client
from pdwire.messages import BlockBatch, BlockFrame, Commit, encode
from tests.kvtransport.test_kvtransport_zmq import BLOCK_NBYTES, GEOM, RawPeer, _until

pytestmark = pytest.mark.timeout(600)
HANG_S = 120.0      # only bounds a hang: a starved machine is slow, never this slow


def _close(recv, peer, routing_id: bytes) -> None:
    """Close peer's connection and wait until the receiver's ROUTER let its routing id go (a send to
    it fails: ROUTER_MANDATORY). Until then libzmq ignores a new connection that brings it."""
    peer.sock.close()
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            recv._link._sock.send_multipart([routing_id, b""], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return
        recv.poll(0.01)
    raise AssertionError("the receiver kept the closed connection's routing id")


def _take_over(recv, routing_id: bytes) -> RawPeer:
    """A new connection with routing_id, once the receiver's ROUTER routes routing_id to it: a send
    to it succeeds (ROUTER_MANDATORY), and the connection reads that empty probe. libzmq ignores a
    new connection whose routing id is still registered, even to a pipe that is closing
    (EHOSTUNREACH already), so a connection ignored for 1 s is replaced (for up to HANG_S)."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        peer, until = RawPeer(recv.endpoint, routing_id=routing_id), time.monotonic() + 1
        while time.monotonic() < until:
            try:
                recv._link._sock.send_multipart([routing_id, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                recv.poll(0.01)
                continue
            assert peer.sock.poll(HANG_S * 1000) and peer.sock.recv_multipart() == [b""]
            return peer
        peer.sock.close()
    raise AssertionError("no new connection took the routing id")


def _next_message(recv, peer) -> list[bytes]:
    _until(recv, lambda: peer.sock.poll(0))
    return peer.sock.recv_multipart()


@pytest.mark.parametrize("sealed_first", [True, False])
def test_a_message_sealed_on_one_connection_is_refused_on_another_with_its_routing_id(sealed_first):
    """Connection A pairs and seals a block message it never sends; after A closes, connection B
    with A's routing id and the right PLAIN password sends A's header and seal (or trailer) with
    payload bytes of its own: dropped (NOT_AUTHENTICATED, counted), answered RESET, no pool byte
    changes and the transfer stays untouched. B then pairs afresh on the same connection (a
    reconnect), A's seal fails under B's new keys (BAD_MAC), and B's own block commits."""
    dst = make_pool(seed=2, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)
    before, src = dst.clone(), make_pool(seed=1, **GEOM)
    routing_id, identity = b"p0/" + os.urandom(8).hex().encode(), make_identity(src, "p0", "zmq")
    a = RawPeer(recv.endpoint, routing_id=routing_id)
    b = None
    try:
        assert a.pair(recv, identity).accepted
        recv.register(Reservation("x1", (3,), sender_node_id="p0"))
        header = BlockFrame("x1", 0, 3, BLOCK_NBYTES, "float32", tuple(dst.shape[1:]))
        captured = a.framer.pack_many(a.session, header, [bytes(BLOCK_NBYTES)], sealed_first)
        _close(recv, a, routing_id)                     # A's message never left
        evil = b"\xee" * BLOCK_NBYTES
        replay = [captured[0], captured[1], evil] if sealed_first else [captured[0], evil, captured[2]]
        b = _take_over(recv, routing_id)
        b.sock.send_multipart(replay)
        _until(recv, lambda: recv.metrics.frames_dropped + recv.metrics.blocks_written > 0)
        assert same_bytes(dst, before) and recv.ledger.state("x1") is TransferState.RESERVED
        assert recv.metrics.drops == {DropReason.NOT_AUTHENTICATED: 1}
        assert _next_message(recv, b) == [auth_frame(AuthKind.RESET)]

        assert b.pair(recv, identity).accepted         # a reconnect: a fresh session
        b.sock.send_multipart(replay)
        _until(recv, lambda: recv.metrics.drops[DropReason.BAD_MAC] == 1)
        assert same_bytes(dst, before)
        b.sock.send_multipart(b.framer.pack_many(b.session, header, [src[1].numpy().tobytes()], sealed_first))
        b.send(Commit("x1", 7, 16))
        events = _until(recv, lambda: recv.ledger.state("x1") is TransferState.COMMITTED)
        assert [type(e) for e in events] == [TransferCommitted]
        assert same_bytes(dst[3], src[1]) and same_bytes(dst[torch.arange(16) != 3], before[torch.arange(16) != 3])
        assert recv.metrics.drops == {DropReason.NOT_AUTHENTICATED: 1, DropReason.BAD_MAC: 1}
    finally:
        for peer in (a, b):
            if peer is not None:
                peer.sock.close()
        recv.close()


def test_payloads_owed_on_a_closed_connection_are_not_taken_from_one_with_its_routing_id():
    """Connection A pairs and sends a split batch's [header, seal] for x1, owing its two payloads,
    then closes; connection B with A's routing id and the PLAIN password sends two bare payloads:
    neither goes into A's slots (A still owes both), each is dropped and counted, and no pool
    byte changes: a payload message, which no MAC covers, lands only from the connection that
    opened the batch."""
    dst = make_pool(seed=2, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)
    before, src = dst.clone(), make_pool(seed=1, **GEOM)
    routing_id, identity = b"p0/" + os.urandom(8).hex().encode(), make_identity(src, "p0", "zmq")
    a, b = RawPeer(recv.endpoint, routing_id=routing_id), None
    try:
        ack = a.pair(recv, identity)
        assert ack.accepted and ack.split_payloads
        recv.register(Reservation("x1", (3, 5), sender_node_id="p0"))
        header = encode(BlockBatch("x1", (0, 1), (3, 5), BLOCK_NBYTES, "float32", tuple(dst.shape[1:])))
        a.sock.send_multipart([header, a.session.seal_first(header, [BLOCK_NBYTES] * 2, split=True)])
        _until(recv, lambda: len(recv._core._owed) == 1)
        (owed,) = recv._core._owed.values()
        _close(recv, a, routing_id)
        b = _take_over(recv, routing_id)
        for _ in range(2):
            b.sock.send(b"\xee" * BLOCK_NBYTES)
        _until(recv, lambda: recv.metrics.frames_dropped == 2)
        assert list(recv._core._owed.values()) == [owed] and owed.sizes == []
        assert same_bytes(dst, before) and recv.metrics.blocks_written == 0
        assert recv.metrics.drops == {DropReason.MALFORMED: 2}     # a lone frame: no sealed message
    finally:
        for peer in (a, b):
            if peer is not None:
                peer.sock.close()
        recv.close()


QUIET_TRIES, QUIET_GAPS = 50, 20


def _router(recv_hwm: int, guarded: bool) -> tuple[zmq.Socket, ThreadGuard | None]:
    """A ROUTER queueing recv_hwm messages per connection: guarded (PLAIN, User-Ids) or not (NULL)."""
    ctx = zmq.Context()
    guard = ThreadGuard(ctx, TEST_SECRET) if guarded else None
    sock = ctx.socket(zmq.ROUTER)
    if guard is not None:
        guard.start()
        guard.protect(sock, recv_hwm)
    else:
        sock.rcvhwm = recv_hwm
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    return sock, guard


def _sent_before_blocking(endpoint: str, plain: bool) -> tuple[zmq.Socket, int]:
    """A DEALER (SNDHWM 1, 4 KiB socket buffer), and how many 4 MiB messages it sent to endpoint,
    which reads none, before its sends stayed blocked: over QUIET_TRIES tries in a row (so this
    thread, and libzmq's I/O threads beside it, ran meanwhile: a starved process's pause is no
    full queue) and for QUIET_GAPS times the longest wait between two sends that went (1 s at
    least), which a slow machine makes longer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    for opt, value in ((zmq.SNDHWM, 1), (zmq.SNDBUF, 4096), (zmq.LINGER, 0)):
        sock.setsockopt(opt, value)
    if plain:
        plain_client(sock, TEST_SECRET)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(endpoint)
    assert monitor.poll(HANG_S * 1000), "no handshake"     # counted from then: a slow handshake is not a full queue
    recv_monitor_message(monitor)
    sock.disable_monitor()
    monitor.close()
    sent, last, gap, tries = 0, time.monotonic(), 0.0, 0
    while tries < QUIET_TRIES or time.monotonic() - last < max(1.0, QUIET_GAPS * gap):
        try:
            sock.send_multipart([b"h", bytes(4 << 20)], zmq.NOBLOCK)
            now = time.monotonic()
            sent, last, gap, tries = sent + 1, now, max(gap, now - last), 0
        except zmq.Again:
            tries += 1
            time.sleep(0.02)
    return sock, sent


@pytest.mark.parametrize("recv_hwm", [1, 2])
def test_a_connections_user_id_takes_no_slot_of_its_receive_queue(recv_hwm):
    """libzmq queues a connection's User-Id as a message that its pipe never counts as read;
    protect() adds that slot, so a guarded ROUTER lets a connection queue as many messages as an
    unguarded one with the same high-water mark (with RCVHWM 1 and no slot added: none at all),
    and hands every one over, named by the connection's User-Id."""
    (plain, _), (guarded, guard) = _router(recv_hwm, False), _router(recv_hwm, True)
    socks = [plain, guarded]
    try:
        control, want = _sent_before_blocking(plain.getsockopt_string(zmq.LAST_ENDPOINT), False)
        sender, sent = _sent_before_blocking(guarded.getsockopt_string(zmq.LAST_ENDPOINT), True)
        socks += [control, sender]
        assert sent == want
        names = []
        while len(names) < sent and guarded.poll(HANG_S * 1000):
            names.append(connection_name(guarded.recv(copy=False)))
            assert len(guarded.recv_multipart()) == 2
        assert not guarded.poll(1000), "more messages than were sent"
        assert len(names) == sent and set(names) == {names[0]} and names[0].endswith(".1")
    finally:
        for sock in socks:
            sock.close()
        guard.stop()
        plain.context.term()
        guarded.context.term()
