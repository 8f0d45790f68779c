"""A KV message's header is small: MAX_HEADER_BYTES (64 KiB) holds the largest legal one of every
kind that travels between nodes with room to spare; a sender names its open transfers over as
many heartbeats as it takes; a receiver's MAXMSGSIZE admits the largest header even where its
blocks are smaller, and a sender's admits the largest reply a heartbeat gets."""
import time

import pytest

from kvtransport.fake import FakeNetwork, FakeReceiver, FakeSender, ManualClock
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, TINY_MODEL, make_identity, make_pool
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_send_link import MAX_REPLY_BYTES
from kvtransport.zmq_sender import ZmqSender
from pdwire.handshake import KVLayout, PeerIdentity
from pdwire.messages import (BATCH_BYTES_LIMIT, MAX_BATCH_BLOCKS, MAX_HEADER_BYTES, MAX_HEARTBEAT_XFERS, Abort,
                             BlockBatch, BlockFrame, Commit, Heartbeat, Hello, HelloAck, LayerBatch, P2PJoin, decode,
                             encode)
from pdwire.schema import MAX_BLOCKS, MAX_ID_LEN, MAX_TEXT_LEN, MAX_TOKEN_ID, ProtocolError
from tests.kvtransport.test_kvtransport_zmq import HANG_S, _connect

pytestmark = pytest.mark.timeout(300)

ID = "x" * MAX_ID_LEN
WIDE = "\U0001F600" * MAX_TEXT_LEN          # the longest text, at 4 bytes a character
TOP_INDICES = tuple(range(MAX_BLOCKS - MAX_BATCH_BLOCKS, MAX_BLOCKS))
TOP_IDS = tuple(range((1 << 31) - MAX_BATCH_BLOCKS, 1 << 31))
BLOCK = (1 << 34, "float8_e4m3fn", (1 << 20,) * 8)
IDENT = PeerIdentity(ID, ID, "t" * 16, KVLayout(ID, "float8_e4m3fn", *(1 << 16,) * 4, "\U0001F600" * 128, 1 << 16))

LARGEST = [                                 # the largest legal message of each kind on the KV link
    Hello(IDENT),
    HelloAck(IDENT, False, WIDE, BATCH_BYTES_LIMIT, True, True, True),
    P2PJoin(ID, "h" * 255, 65535),
    BlockFrame(ID, MAX_BLOCKS - 1, (1 << 31) - 1, *BLOCK),
    BlockBatch(ID, TOP_INDICES, TOP_IDS, *BLOCK),
    LayerBatch(ID, TOP_INDICES, TOP_IDS, 1 << 16, *BLOCK),
    Commit(ID, MAX_TOKEN_ID, MAX_BLOCKS << 16),
    Abort(ID, WIDE),
    Heartbeat(ID, (ID,) * MAX_HEARTBEAT_XFERS),
]


def test_the_largest_legal_header_of_every_kv_kind_fits_the_cap_twice_over():
    """MAX_HEADER_BYTES is 64 KiB at most, and holds the largest legal header of each kind twice
    (a batch's: under 1 KB; a HelloAck's: under 3 KB; a full Heartbeat's: under 17 KB)."""
    assert MAX_HEADER_BYTES <= 64 << 10
    assert max(len(encode(m)) for m in LARGEST) * 2 <= MAX_HEADER_BYTES
    assert max(len(encode(m)) for m in LARGEST if type(m) in (BlockBatch, LayerBatch)) < 1000


def test_a_heartbeat_names_no_more_than_its_bound():
    """A Heartbeat naming MAX_HEARTBEAT_XFERS + 1 transfers is not a message."""
    with pytest.raises(ProtocolError, match="open_xfers"):
        Heartbeat(ID, ("x1",) * (MAX_HEARTBEAT_XFERS + 1))


def test_more_open_transfers_than_one_heartbeat_names_all_stay_leased():
    """A sender with 2 * MAX_HEARTBEAT_XFERS + 1 transfers open on one receiver names them over
    three heartbeats a tick: all of them outlive their leases many times over, none dropped."""
    clock = ManualClock()
    net = FakeNetwork(clock)
    src, dst = make_pool(seed=1), make_pool(seed=2)
    recv = FakeReceiver(net, "d0", dst, make_identity(dst, "d0"), TEST_SECRET, 10.0)
    send = FakeSender(net, make_identity(src, "p0"), TEST_SECRET, heartbeat_interval=1.0, peer_timeout=10.0)
    xfers = [f"h{k}" for k in range(2 * MAX_HEARTBEAT_XFERS + 1)]
    send.connect(recv.endpoint)
    for k, xfer_id in enumerate(xfers):
        recv.register(Reservation(xfer_id, (k % dst.shape[0],), cached_prefix_blocks=1, lease_s=5.0))
        send.begin(xfer_id, recv.endpoint)
    clock.advance(1.0)
    assert [len(decode(beat[0]).open_xfers) for _, beat in send._core.due_heartbeats()] == \
        [MAX_HEARTBEAT_XFERS, MAX_HEARTBEAT_XFERS, 1]
    events = []
    for _ in range(30):
        clock.advance(1.0)
        events += send.poll() + recv.poll()
    assert events == [] and sorted(recv.ledger.live_xfers()) == sorted(xfers)
    assert recv.metrics.frames_dropped == 0 and send.metrics.frames_dropped == 0


def test_a_receiver_of_small_blocks_takes_the_largest_header():
    """A ZMQ receiver whose blocks are 8 bytes takes a Heartbeat of MAX_HEARTBEAT_XFERS longest ids
    (its MAXMSGSIZE is the header cap's, not the block's, plus a little)."""
    geom = dict(num_blocks=4, num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)
    src, dst = make_pool(seed=1, **geom), make_pool(seed=None, **geom)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET)
    seen, handle = [], recv._link._handle
    recv._link._handle = lambda peer, frames: (seen.append(len(frames[0])), handle(peer, frames))
    try:
        _connect(send, recv)
        beat = Heartbeat(send._core.identity.epoch, (ID,) * MAX_HEARTBEAT_XFERS)
        send._link.send(recv.endpoint, send._core.pack(recv.endpoint, beat))
        deadline = time.monotonic() + HANG_S
        while len(encode(beat)) not in seen and time.monotonic() < deadline:
            recv.poll(0.02)
        assert len(encode(beat)) in seen and recv.metrics.frames_dropped == 0
    finally:
        send.close()
        recv.close()


def test_a_heartbeats_largest_reply_reaches_a_zmq_sender():
    """A receiver (its epoch the longest id) that holds MAX_HEARTBEAT_XFERS transfers of the longest
    ids answers the heartbeat naming them all with one naming them all back: its largest reply, a
    frame the sender's MAXMSGSIZE (MAX_REPLY_BYTES) takes over a real socket (a larger one would
    disconnect the sender silently); nothing dropped, no transfer failed."""
    geom = dict(num_blocks=4, num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)
    src, dst = make_pool(seed=1, **geom), make_pool(seed=None, **geom)
    recv = ZmqReceiver(dst, PeerIdentity("d0", "e" * MAX_ID_LEN, "zmq", KVLayout.for_pool(dst, TINY_MODEL)),
                       TEST_SECRET)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, heartbeat_interval=0.05)
    xfers = tuple(f"{k:0{MAX_ID_LEN}d}" for k in range(MAX_HEARTBEAT_XFERS))
    largest = len(encode(Heartbeat("e" * MAX_ID_LEN, xfers)))
    seen, handle = [], send._core.handle
    send._core.handle = lambda endpoint, frames: (seen.append(len(frames[0])), handle(endpoint, frames))
    try:
        _connect(send, recv)
        for k, xfer_id in enumerate(xfers):
            recv.register(Reservation(xfer_id, (k % geom["num_blocks"],), cached_prefix_blocks=1, lease_s=HANG_S))
            send.begin(xfer_id, recv.endpoint)
        events, deadline = [], time.monotonic() + HANG_S
        while largest not in seen and time.monotonic() < deadline:
            events += send.poll(0.02) + recv.poll(0.02)
        assert largest in seen and largest <= MAX_REPLY_BYTES // 2
        assert events == [] and send.metrics.frames_dropped == 0 and recv.metrics.frames_dropped == 0
    finally:
        send.close()
        recv.close()
