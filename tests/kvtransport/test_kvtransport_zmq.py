"""ZMQ backend over TCP and IPC: real blocks between two pools, bit-exact, hostile peers ignored."""
import os
import tempfile
import threading
import time
from collections import Counter

import msgpack
import pytest
import torch
import zmq

from kvtransport.base import TransportError
from kvtransport.events import FailReason, TransferCommitted, TransferFailed
from kvtransport.framing import Framer
from pdwire.messages import BATCH_BYTES, BlockFrame, Hello, announced_batch_bytes
from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from kvtransport.session import AuthKind, Initiator, auth_frame, parse_auth_frame
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender
from kvtransport.zmtp_auth import plain_client
from tests.kvtransport.queue_probe import in_flight, queued_bytes, small_kernel_buffers

pytestmark = pytest.mark.timeout(600)
HANG_S = 120.0      # only bounds a hang: a starved machine is slow, never this slow

GEOM = dict(num_blocks=16, num_layers=2, block_size=16, num_kv_heads=2, head_dim=32)
BLOCK_NBYTES = 2 * 2 * 16 * 2 * 32 * 4      # one block of GEOM in float32: 16 KiB
DST_IDS = (9, 3, 12, 0, 7, 5)           # block 9 is a cached prefix: not shipped
SRC_IDS = (1, 2, 3, 4, 5, 6)
NUM_TOKENS = 5 * 16 + 7                 # the last block is partial


def _bind(kind):
    if kind == "tcp":
        return "tcp://127.0.0.1:*"
    return f"ipc://{tempfile.mkdtemp(prefix='kvt')}/d0.sock"


def _pair(kind, dtype=torch.float32, **recv_kw):
    src, dst = make_pool(dtype=dtype, seed=1, **GEOM), make_pool(dtype=dtype, seed=2, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, _bind(kind), **recv_kw)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET)
    return src, dst, recv, send


def _connect(send, recv, timeout=HANG_S):
    """Run send.connect in a thread while the receiver's loop polls (as on a real node)."""
    out = []
    t = threading.Thread(target=lambda: out.append(send.connect(recv.endpoint, timeout)))
    t.start()
    while t.is_alive():
        recv.poll(0.02)
    assert out, "connect failed"
    return out[0]


def _ship(send, src, xfer_id="x1", indices=range(1, 6), commit=True):
    for i in indices:
        send.send_block(xfer_id, i, DST_IDS[i], src, SRC_IDS[i])
    if commit:
        send.commit(xfer_id, 777, NUM_TOKENS)


def _events(recv, n=1, timeout=HANG_S):
    deadline, events = time.monotonic() + timeout, []
    while len(events) < n and time.monotonic() < deadline:
        events += recv.poll(0.05)
    return events


def _until(recv, cond, timeout=HANG_S):
    """Poll the receiver until cond() holds (frames from several sockets interleave freely)."""
    deadline, events = time.monotonic() + timeout, []
    while not cond() and time.monotonic() < deadline:
        events += recv.poll(0.02)
    assert cond()
    return events


def _written_exactly(dst, before, src):
    """Shipped blocks hold the source bytes; every other destination block is unchanged."""
    shipped = {DST_IDS[i]: SRC_IDS[i] for i in range(1, 6)}
    return all(same_bytes(dst[b], src[shipped[b]] if b in shipped else before[b])
               for b in range(dst.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_blocks_move_bit_exactly(kind, dtype):
    """Over TCP and IPC, fp32 and bf16 blocks land bit-exactly in their reserved blocks only."""
    src, dst, recv, send = _pair(kind, dtype)
    before = dst.clone()
    try:
        assert _connect(send, recv).node_id == "d0"
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        _ship(send, src)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted)
        assert (ev.xfer_id, ev.first_token, ev.num_tokens) == ("x1", 777, NUM_TOKENS)
        assert ev.dst_block_ids == DST_IDS
        assert ev.nbytes == 5 * dst[0].numel() * dst.element_size()
        assert _written_exactly(dst, before, src)
        assert recv.metrics.drops == Counter()
        deadline = time.monotonic() + HANG_S
        while not send.is_sent("x1") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert send.is_sent("x1")
    finally:
        send.close()
        recv.close()


def test_binds_loopback_by_default():
    """Without an address the receiver listens on 127.0.0.1 only."""
    _, _, recv, send = _pair("tcp")
    assert recv.endpoint.startswith("tcp://127.0.0.1:")
    send.close()
    recv.close()


class RawPeer:
    """A raw DEALER on the receiver's port; pair() runs the handshake and Hello by hand."""

    def __init__(self, endpoint, secret=TEST_SECRET, routing_id=None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        plain_client(self.sock, TEST_SECRET)      # past ZMTP PLAIN: these tests aim at the session
        self.sock.connect(endpoint)
        self.initiator, self.framer, self.session = Initiator(secret), Framer(), None

    def pair(self, recv, identity, wait=HANG_S):
        """Our Hello's answer (a HelloAck), or None if the receiver said nothing within wait s."""
        self.sock.send(self.initiator.hello())
        _until(recv, lambda: self.sock.poll(0))
        self.session = self.initiator.on_challenge(parse_auth_frame(self.sock.recv_multipart())[1])
        self.send(Hello(identity))
        deadline = time.monotonic() + wait
        while not self.sock.poll(0) and time.monotonic() < deadline:
            recv.poll(0.02)
        if not self.sock.poll(0):
            return None
        return self.framer.unpack(self.session, self.sock.recv_multipart()).msg

    def send(self, msg, payload=None):
        self.sock.send_multipart(self.framer.pack(self.session, msg, payload))


def test_hostile_peers_never_disturb_a_good_transfer():
    """Garbage, unauthenticated, misaddressed and oversize frames are dropped while a good
    transfer commits."""
    src, dst, recv, send = _pair("tcp")
    before = dst.clone()
    nbytes = dst[0].numel() * dst.element_size()
    try:
        _connect(send, recv)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1, sender_node_id="p0"))
        send.begin("x1", recv.endpoint)
        stranger, paired, giant = RawPeer(recv.endpoint), RawPeer(recv.endpoint), RawPeer(recv.endpoint)
        assert paired.pair(recv, make_identity(src, "evil", "zmq")).accepted
        good_hdr = BlockFrame("x1", 2, DST_IDS[2], nbytes, "float32", tuple(dst.shape[1:]))
        stranger.sock.send_multipart([os.urandom(64)])
        stranger.sock.send_multipart([msgpack.packb([1, "block", [1, 2]]), b"x"])
        stranger.sock.send_multipart(paired.framer.pack(paired.session, good_hdr, b"\xee" * nbytes))
        stranger.sock.send_multipart([b"a", b"b", b"c", b"d"])              # no trailer: BAD_MAC
        giant.sock.send_multipart([b"\x00" * (2 << 20)])                  # above MAXMSGSIZE
        _ship(send, src, indices=(1, 2), commit=False)                  # p0 claims x1
        assert _until(recv, lambda: recv.metrics.blocks_written == 2) == []
        paired.send(good_hdr, b"\xee" * nbytes)                          # x1 is p0's
        paired.send(BlockFrame("x1", 2, 4, nbytes, "float32", tuple(dst.shape[1:])), b"\xee" * nbytes)
        expected = Counter({DropReason.MALFORMED: 1, DropReason.BAD_MAC: 2, DropReason.NOT_AUTHENTICATED: 1,
                            DropReason.WRONG_PEER: 2})
        assert _until(recv, lambda: recv.metrics.drops == expected) == []
        _ship(send, src, indices=(3, 4, 5))
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted)
        assert _written_exactly(dst, before, src)
        assert recv.metrics.drops == expected
        assert stranger.sock.poll(0) and stranger.sock.recv_multipart() == [auth_frame(AuthKind.RESET)]
        for peer in (stranger, paired, giant):
            peer.sock.close()
    finally:
        send.close()
        recv.close()


def test_peer_with_another_secret_cannot_pair_over_zmq():
    """A peer holding another secret gets a challenge, fails its proof (BAD_MAC) and hears nothing
    more; the good pair's transfer commits untouched."""
    src, dst, recv, send = _pair("tcp")
    before = dst.clone()
    try:
        _connect(send, recv)
        intruder = RawPeer(recv.endpoint, secret=b"q" * 32)
        assert intruder.pair(recv, make_identity(src, "p0", "zmq"), wait=0.5) is None
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        _ship(send, src)
        assert [type(e) for e in _events(recv, n=1)] == [TransferCommitted]
        assert recv.metrics.drops == Counter({DropReason.BAD_MAC: 1})
        assert _written_exactly(dst, before, src)
        intruder.sock.close()
    finally:
        send.close()
        recv.close()


def test_dead_sender_fails_its_transfer():
    """A sender that vanishes mid-transfer is declared dead after peer_timeout; one event."""
    src, dst, recv, send = _pair("tcp", peer_timeout=0.5)
    before = dst.clone()
    try:
        _connect(send, recv)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1, lease_s=60))
        send.begin("x1", recv.endpoint)
        _ship(send, src, indices=(1,), commit=False)
        send.close()
        assert len(recv._core._auth._sessions) == 1
        events = _events(recv)                      # waited for (0.5 s of silence, however long polls take)
        events += _events(recv, timeout=1.0)        # then a second, which must not come
        assert events == [TransferFailed("x1", FailReason.PEER_DEAD, "silent for 0.5s")]
        assert recv._core._auth._sessions == {}    # its session keys went with it
        assert same_bytes(dst[DST_IDS[1]], src[SRC_IDS[1]])
        assert all(same_bytes(dst[b], before[b]) for b in range(16) if b != DST_IDS[1])
    finally:
        recv.close()


def test_dead_receiver_fails_open_transfers_on_sender():
    """A receiver that goes silent fails the sender's open transfers once (PEER_DEAD)."""
    src, dst = make_pool(seed=1, **GEOM), make_pool(seed=2, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, heartbeat_interval=0.1, peer_timeout=0.5)
    try:
        _connect(send, recv)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        recv.close()
        events, deadline = [], time.monotonic() + HANG_S
        while not events and time.monotonic() < deadline:
            events += send.poll(0.1)
        assert events == [TransferFailed("x1", FailReason.PEER_DEAD, "silent for 0.5s")]
        send.send_block("x1", 1, DST_IDS[1], src, SRC_IDS[1])     # no-op, no raise
    finally:
        send.close()


def test_backpressure_raises_when_receiver_stops_draining():
    """With the queues full (high-water marks: two blocks' bytes here, two messages there),
    send_block raises TransportError, not hangs; the receiver is lost with it: its other transfer
    fails (PEER_DEAD) without a send into the full queue (the caller is not held for the send
    timeout again), and no Commit or Abort goes there."""
    geom = dict(GEOM, num_blocks=64, block_size=256)                      # 256 KiB blocks
    src, dst = make_pool(seed=1, **geom), make_pool(seed=None, **geom)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, hwm=2, max_queue_bytes=512 << 10)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, hwm=2, send_timeout=0.3, split_payloads=False)
    try:
        _connect(send, recv)
        recv.register(Reservation("x1", tuple(range(64))))
        send.begin("x1", recv.endpoint)
        send.begin("x2", recv.endpoint)
        with pytest.raises(TransportError, match="not draining"):
            for i in range(64):                                          # nobody polls recv
                send.send_block("x1", i, i, src, i)
        sent = send.metrics.blocks_sent
        send.send_block("x2", 0, 0, src, 0)
        send.commit("x2", 7, 1)
        send.abort("x1")
        assert (send.metrics.blocks_sent, send.metrics.commits_sent, send.metrics.aborts_sent) == (sent, 0, 0)
        assert sorted((e.xfer_id, e.reason) for e in send.poll(0.0)) == [("x1", FailReason.PEER_DEAD),
                                                                          ("x2", FailReason.PEER_DEAD)]
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("split, queue_bytes, batch_bytes, hwm, cap, want", [
    (False, 256 << 20, 16 << 20, 4, None, 4),   # announced 2 MiB (no split): 128 fit, hwm is the bound
    (False, 8 << 20, 16 << 20, 64, None, 4),    # 8 MiB as 4 messages of the 2 MiB announced, not 16 MiB's 0
    (False, 1 << 20, 16 << 20, 64, None, 1),    # a budget below one message: one message
    (False, 3 * BLOCK_NBYTES, BLOCK_NBYTES // 4, 64, None, 3),   # a message carries one block at least
    (True, 1 << 20, 16 << 20, 16, None, (1 << 20) // BLOCK_NBYTES),   # split: single blocks, hwm no bound
    (True, 3 * BLOCK_NBYTES, 16 << 20, 64, None, 3),
    (True, 2 << 30, 16 << 20, 64, 8, 8),        # at most MAX_SPLIT_HWM (made 8 here)
    (True, BLOCK_NBYTES // 2, 16 << 20, 64, None, 1),
    (True, 1 << 20, BATCH_BYTES, 16, None, (1 << 20) // BLOCK_NBYTES),   # the default batch (128 MiB): no more
    (False, 8 << 20, BATCH_BYTES, 64, None, 4),   # queued than 16 MiB's, split or whole (2 MiB messages)
])
def test_receive_queue_is_bounded_in_bytes(monkeypatch, split, queue_bytes, batch_bytes, hwm, cap, want):
    """What one peer gets queued on a receiver nobody polls, measured (tests/kvtransport/queue_probe):
    max_queue_bytes of the messages it may send, single blocks to a receiver that splits (at most
    MAX_SPLIT_HWM of them), else batches of the bytes it announced (2 MiB at most), or of one block
    if that is larger, never more than hwm; one message at least; give or take what is in flight
    (in_flight()). Replies keep hwm."""
    if cap is not None:
        monkeypatch.setattr("kvtransport.zmq_receiver.MAX_SPLIT_HWM", cap)
    small_kernel_buffers(monkeypatch)
    dst = make_pool(seed=None, **GEOM)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, hwm=hwm, split_payloads=split,
                       max_batch_bytes=batch_bytes, max_queue_bytes=queue_bytes)
    message = BLOCK_NBYTES if split else max(announced_batch_bytes(batch_bytes, False), BLOCK_NBYTES)
    try:
        got = queued_bytes(recv, message, min(message, BLOCK_NBYTES), want * message + 2 * in_flight(message))
        assert want * message <= got <= want * message + in_flight(message), (got / message, want)
        assert recv._link._sock.getsockopt(zmq.SNDHWM) == hwm
    finally:
        recv.close()


def test_receive_queue_budget_must_be_positive():
    dst = make_pool(seed=None, **GEOM)
    with pytest.raises(ValueError, match="max_queue_bytes"):
        ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, max_queue_bytes=0)
