"""Split payloads against a busy receiver, and the receiver's own say over the split: a peer may
queue as many bytes of single-block messages as of whole batches (ZeroMQ counts messages, not
bytes), a poll drains by bytes, the queue is sized from what the receiver announces, and a
receiver that did not announce the split takes none of it."""
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import zmq

from kvtransport.events import TransferCommitted
from kvtransport.metrics import DropReason
from kvtransport.payload import BlockWriterSink
from kvtransport.receiver_state import Reservation
from kvtransport.session import AuthError, Session
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender
from kvtransport.zmtp_auth import USER_ID_SLOTS
from pdwire.messages import RECV_QUEUE_BYTES, HelloAck, decode, encode
from tests.kvtransport.queue_probe import in_flight, kernel_bytes, queued_bytes, small_kernel_buffers
from tests.kvtransport.test_kvtransport_split import _split_header
from tests.kvtransport.test_kvtransport_zmq import DST_IDS, GEOM, HANG_S, NUM_TOKENS, _connect, _pair, _until

pytestmark = pytest.mark.timeout(120)

BIG = dict(num_blocks=1024, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)   # 64 KiB blocks
BIG_NBYTES = 64 << 10


def _rcvhwm(recv) -> int:
    return recv._link._sock.getsockopt(zmq.RCVHWM) - USER_ID_SLOTS     # zmtp_auth: one slot held for good


@pytest.mark.parametrize("form", ["blocks", "layer slices"])
def test_a_busy_receiver_queues_a_whole_transfer_of_single_payloads(form):
    """While the receiver is not polled (its node busy), 1024 blocks of 64 KiB (or 4 layer groups
    of 1024 blocks: 4096 slices) sent split all queue without blocking the sender past its send
    timeout (16 messages queued per peer before the fix, all 1024 on the whole form's 64 x 2 MiB),
    and one poll then takes all of them that reached the receiver: all but what the kernel still
    holds, counted from /proc/net/tcp (256 messages a poll before: 16 or 4 of the 64 MiB at most; no time
    cap on a poll here, max_poll_s: its byte budget is under test)."""
    src, dst = make_pool(seed=1, **BIG), make_pool(seed=2, **BIG)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, max_poll_s=HANG_S)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, send_timeout=2.0)
    ids = list(range(1024))
    try:
        assert _rcvhwm(recv) == RECV_QUEUE_BYTES // BIG_NBYTES == 4096
        _connect(send, recv)
        assert send._core.splits(recv.endpoint)
        recv.register(Reservation("x1", tuple(ids)))
        send.begin("x1", recv.endpoint)
        if form == "blocks":                    # nobody polls recv until every payload has left
            send.send_blocks("x1", ids, ids, src, ids)
        else:
            for layer in range(4):
                send.send_layers("x1", ids, ids, src, ids, layer, 1)
        send.commit("x1", 7, 1024 * 16)
        deadline = time.monotonic() + HANG_S
        while not send.is_sent("x1") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert send.is_sent("x1")
        # what left the sender is in the receiver's queue, in the kernel, or (a message at most) being read
        arrived = 1024 * BIG_NBYTES - kernel_bytes(recv.endpoint) - BIG_NBYTES
        events = recv.poll(0)
        assert recv.metrics.bytes_written >= arrived, (recv.metrics.bytes_written >> 20, arrived >> 20)
        events += _until(recv, lambda: recv.metrics.transfers_committed == 1)
        assert [type(e) for e in events] == [TransferCommitted]
        assert recv.metrics.drops == Counter() and recv.metrics.blocks_written == 1024
        assert recv.metrics.bytes_written == 1024 * BIG_NBYTES
        assert all(same_bytes(dst[i], src[i]) for i in ids)
    finally:
        send.close()
        recv.close()


def test_the_queue_is_sized_from_the_bytes_announced(monkeypatch):
    """What one peer gets queued, measured (tests/kvtransport/queue_probe): a receiver that does not
    split (a sink without slots, or built so) announces 2 MiB batches and lets a peer queue
    max_queue_bytes of them (8 MiB: 4, not the one message that 8 MiB / the 16 MiB it was configured
    for would give); one that splits, max_queue_bytes of single blocks (whatever hwm says)."""
    small_kernel_buffers(monkeypatch)
    pool = make_pool(**GEOM)
    identity = make_identity(pool, "d0", "zmq")
    no_slots = BlockWriterSink(lambda ids, blocks: None, identity.layout)
    block = identity.layout.block_nbytes
    cases = [(dict(sink=no_slots, max_queue_bytes=8 << 20), 2 << 20, 4),
             (dict(split_payloads=False, max_queue_bytes=8 << 20), 2 << 20, 4),
             (dict(max_queue_bytes=1 << 20, hwm=16), block, (1 << 20) // block)]
    receivers = []
    try:
        for kw, _, _ in cases:
            receivers.append(ZmqReceiver(pool, identity, TEST_SECRET, **kw))

        def probe(recv, message: int, want: int) -> int:
            return queued_bytes(recv, message, min(message, block), want * message + 2 * in_flight(message))
        # the three receivers are probed at once: each probe ends in a send blocked for SEND_BLOCKED_S,
        # waited out side by side rather than one after another (each probe has its own peer and context)
        with ThreadPoolExecutor(len(cases)) as probes:
            got = list(probes.map(probe, receivers, [c[1] for c in cases], [c[2] for c in cases]))
        for (kw, message, want), g in zip(cases, got):
            assert want * message <= g <= want * message + in_flight(message), (kw, g / message, want)
    finally:
        for recv in receivers:
            recv.close()


def test_a_receiver_without_the_split_takes_none_of_it():
    """A split seal sent to a receiver built with split_payloads=False is dropped (UNEXPECTED),
    its payload messages too (MALFORMED), nothing lands or stays owed, and the same
    blocks then sent in the one-message form commit."""
    src, dst, recv, send = _pair("tcp", split_payloads=False)
    ep = recv.endpoint
    try:
        _connect(send, recv)
        assert not send._core.splits(ep)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", ep)
        header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
        send._link.send(ep, _split_header(send, ep, header, [header.nbytes] * 2))
        for payload in send._channel.inline_many(src, [1, 2]):
            send._link.send(ep, [payload])
        _until(recv, lambda: recv.metrics.drops == Counter({DropReason.UNEXPECTED: 1, DropReason.MALFORMED: 2}))
        assert recv.metrics.blocks_written == 0 and recv._core._owed == {}
        send.send_blocks("x1", [1, 2, 3, 4, 5], list(DST_IDS[1:]), src, [1, 2, 3, 4, 5])
        send.commit("x1", 777, NUM_TOKENS)
        events = _until(recv, lambda: recv.metrics.transfers_committed == 1)
        assert [type(e) for e in events] == [TransferCommitted] and recv.metrics.blocks_written == 5
    finally:
        send.close()
        recv.close()


def test_a_session_opens_a_split_seal_only_when_told_to():
    """Session.open takes [header, split seal] only with split=True; else UNEXPECTED, and the
    sequence number is not spent (the same message then opens with split=True)."""
    ours = Session(TEST_SECRET, bytes(16), bytes(16), initiator=True)
    theirs = Session(TEST_SECRET, bytes(16), bytes(16), initiator=False)
    frames = [b"hdr", ours.seal_first(b"hdr", [3, 4], split=True)]
    with pytest.raises(AuthError) as e:
        theirs.open(frames)
    assert e.value.reason is DropReason.UNEXPECTED
    assert theirs.open(frames, split=True) == [b"hdr"]


def test_a_hello_ack_without_the_split_is_what_an_older_sender_decodes():
    """A HelloAck that does not announce the split leaves that last field off (six fields, as
    before it, which a sender from before it decodes: its codec refuses a seventh); one that
    does carries it; both decode back to the same message."""
    identity = make_identity(make_pool(**GEOM), "d0", "zmq")
    for split, n in [(False, 6), (True, 7)]:
        ack = HelloAck(identity, True, max_batch_bytes=16 << 20, layer_slices=True, sealed_first=True,
                       split_payloads=split)
        assert len(msgpack.unpackb(encode(ack))[2]) == n
        assert decode(encode(ack)) == ack
