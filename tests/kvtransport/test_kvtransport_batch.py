"""BlockBatch: blocks ready together travel in one sealed message, land bit-exactly, and a bad
batch is dropped whole and counted while the receiver keeps serving."""
from collections import Counter

import pytest
import torch

from kvtransport.events import FailReason, TransferCommitted, TransferFailed
from kvtransport.fake import FakeNetwork, FakeReceiver, FakeSender, FaultPlan, ManualClock
from kvtransport.metrics import DropReason
from kvtransport.payload import block_bytes
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from pdwire.messages import MAX_BATCH_BLOCKS, OLD_ACK_BATCH_BYTES, BlockBatch, batch_blocks
from tests.kvtransport.test_kvtransport_fake import DST_IDS, SHIPPED, SRC_IDS, Env
from tests.kvtransport import test_kvtransport_zmq as zmq_case

NBYTES = 1024                   # a block of make_pool's default geometry
SHAPE = (2, 2, 4, 2, 8)


def _batch(**over):
    f = dict(xfer_id="x1", indices=(1, 2), block_ids=(6, 7), nbytes=NBYTES, dtype="float32", shape=SHAPE)
    f.update(over)
    return BlockBatch(**f)


def _ship_batch(env, indices=(1, 2, 3), commit=True):
    env.send.send_blocks("x1", list(indices), [DST_IDS[i] for i in indices], env.src,
                         [SRC_IDS[i] for i in indices])
    if commit:
        env.send.commit("x1", first_token=42, num_tokens=14)


def test_batch_size_follows_block_bytes():
    """A batch holds as many blocks as fit OLD_ACK_BATCH_BYTES, at least one, at most MAX_BATCH_BLOCKS."""
    assert batch_blocks(NBYTES, OLD_ACK_BATCH_BYTES) == MAX_BATCH_BLOCKS
    assert batch_blocks(512 << 10, OLD_ACK_BATCH_BYTES) == OLD_ACK_BATCH_BYTES // (512 << 10) == 8
    assert batch_blocks(OLD_ACK_BATCH_BYTES * 2, OLD_ACK_BATCH_BYTES) == 1
    assert batch_blocks(2 << 20, 16 << 20) == 8 and batch_blocks(2 << 20, 3 << 20) == 1
    assert batch_blocks(512 << 10, 256 << 20) == MAX_BATCH_BLOCKS


def _capped_pair(send_cap, recv_cap, faults=FaultPlan()):
    """A FakeSender packing up to send_cap bytes, paired with a FakeReceiver taking recv_cap; 10
    blocks reserved as x1 (block i -> pool block 9 - i)."""
    net = FakeNetwork(ManualClock())
    src, dst = make_pool(num_blocks=10, seed=1), make_pool(num_blocks=10, seed=None)
    recv = FakeReceiver(net, "d0", dst, make_identity(dst, "d0"), TEST_SECRET, max_batch_bytes=recv_cap)
    send = FakeSender(net, make_identity(src, "p0"), TEST_SECRET, faults, max_batch_bytes=send_cap)
    send.connect(recv.endpoint)
    recv.register(Reservation("x1", tuple(range(9, -1, -1))))
    send.begin("x1", recv.endpoint)
    return src, dst, recv, send


@pytest.mark.parametrize("send_cap, recv_cap", [(4 * NBYTES, 64 * NBYTES), (64 * NBYTES, 4 * NBYTES)])
def test_batches_take_the_smaller_of_both_caps(send_cap, recv_cap):
    """A sender packs up to its own cap and the one the receiver announced in its HelloAck,
    whichever is smaller: 10 blocks at 4 a message, so losing message 1 loses exactly blocks 4-7."""
    src, dst, recv, send = _capped_pair(send_cap, recv_cap, FaultPlan(drop=frozenset({1})))
    ids = list(range(10))
    send.send_blocks("x1", ids, ids[::-1], src, ids)
    recv.poll()
    assert recv.metrics.blocks_written == 6 and recv.metrics.drops == Counter()
    assert all(same_bytes(dst[9 - i], src[i]) == (i not in (4, 5, 6, 7)) for i in ids)


def test_batch_over_the_announced_cap_is_dropped_whole():
    """A sender that ignores the receiver's announced cap (3 blocks) gets its 4-block batch
    dropped whole as OVERSIZE, before the MAC is checked; batches within the cap still land."""
    src, dst, recv, send = _capped_pair(64 * NBYTES, 3 * NBYTES)
    big = BlockBatch("x1", (0, 1, 2, 3), (9, 8, 7, 6), NBYTES, "float32", SHAPE)
    send.send_raw(recv.endpoint, send.seal(recv.endpoint, big, *[bytes(block_bytes(src, i)) for i in range(4)]))
    recv.poll()
    assert recv.metrics.drops == Counter({DropReason.OVERSIZE: 1}) and not dst.any()
    ids = list(range(10))
    send.send_blocks("x1", ids, ids[::-1], src, ids)
    send.commit("x1", 1, 10 * 4)
    assert [type(e) for e in recv.poll()] == [TransferCommitted]
    assert all(same_bytes(dst[9 - i], src[i]) for i in ids)


def test_blocks_ready_together_travel_in_one_message():
    """send_blocks ships its blocks as one message: losing message 0 loses all three; sent
    again in one batch they land bit-exactly and the transfer commits once."""
    env = Env(FaultPlan(drop=frozenset({0})))
    env.reserve()
    _ship_batch(env, commit=False)
    assert env.recv.poll() == [] and env.recv.metrics.blocks_written == 0
    _ship_batch(env)
    (ev,) = env.recv.poll()
    assert ev == TransferCommitted("x1", 42, 14, DST_IDS, 3 * NBYTES, 0.0, 0.0)
    assert env.written_exactly(SHIPPED)
    assert env.recv.metrics.blocks_written == 3 and env.recv.metrics.drops == Counter()
    assert env.send.metrics.blocks_sent == 6 and env.send.metrics.bytes_sent == 6 * NBYTES


def test_long_runs_split_at_the_batch_size():
    """66 blocks go as a batch of 64 then one of 2: dropping message 1 loses exactly the last 2."""
    clock = ManualClock()
    net = FakeNetwork(clock)
    src, dst = make_pool(num_blocks=70, seed=1), make_pool(num_blocks=70, seed=None)
    recv = FakeReceiver(net, "d0", dst, make_identity(dst, "d0"), TEST_SECRET)
    send = FakeSender(net, make_identity(src, "p0"), TEST_SECRET, FaultPlan(drop=frozenset({1})))
    send.connect(recv.endpoint)
    ids = list(range(66))
    recv.register(Reservation("x1", tuple(reversed(ids))))
    send.begin("x1", recv.endpoint)
    send.send_blocks("x1", ids, ids[::-1], src, ids)
    recv.poll()
    assert recv.metrics.blocks_written == MAX_BATCH_BLOCKS
    assert all(same_bytes(dst[65 - i], src[i]) for i in range(MAX_BATCH_BLOCKS))
    assert not dst[1].any() and not dst[0].any()        # indices 64, 65: never arrived


def _payloads(n, size=NBYTES):
    return [bytes([0xAB]) * size for _ in range(n)]


@pytest.mark.parametrize("batch, payloads, reason", [
    (_batch(dtype="bfloat16"), _payloads(2), DropReason.BAD_DTYPE),
    (_batch(shape=(2, 2, 4, 4, 4)), _payloads(2), DropReason.BAD_SHAPE),
    (_batch(nbytes=2 * NBYTES), _payloads(2), DropReason.BAD_NBYTES),
    (_batch(), _payloads(1), DropReason.BAD_NBYTES),                        # a payload short
    (_batch(), _payloads(3), DropReason.BAD_NBYTES),                        # a payload too many
    (_batch(), [b"\xab" * NBYTES, b"\xab" * (NBYTES - 1)], DropReason.BAD_NBYTES),
    (_batch(), [], DropReason.BAD_NBYTES),                                  # no payload at all
    (_batch(), _payloads(2, 40 << 10), DropReason.OVERSIZE),                # over the receiver's cap
    (_batch(indices=(1, 0), block_ids=(6, 5)), _payloads(2), DropReason.NOT_RESERVED),  # cached block
    (_batch(indices=(1, 2), block_ids=(6, 4)), _payloads(2), DropReason.NOT_RESERVED),  # wrong block
    (_batch(indices=(1, 9), block_ids=(6, 7)), _payloads(2), DropReason.NOT_RESERVED),  # past the table
    (_batch(xfer_id="nope"), _payloads(2), DropReason.UNKNOWN_XFER),
])
def test_bad_batch_is_dropped_whole_and_counted(batch, payloads, reason):
    """A batch with one bad block, a bad payload count or size, or over the cap writes nothing
    (not even its good blocks), counts one drop, and the transfer still commits afterwards."""
    env = Env()
    env.reserve()
    env.send.send_raw(env.recv.endpoint, env.send.seal(env.recv.endpoint, batch, *payloads))
    assert env.recv.poll() == []
    assert env.recv.metrics.drops == Counter({reason: 1})
    assert env.written_exactly(set()) and env.recv.metrics.blocks_written == 0
    _ship_batch(env)
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]
    assert env.written_exactly(SHIPPED)


def test_batch_repeating_a_written_block_is_dropped_whole():
    """A batch naming a block already written is a DUPLICATE: neither of its blocks is written."""
    env = Env()
    env.reserve()
    _ship_batch(env, indices=(1,), commit=False)
    good = bytes(block_bytes(env.src, SRC_IDS[2]))
    env.send.send_raw(env.recv.endpoint, env.send.seal(env.recv.endpoint, _batch(), b"\x07" * NBYTES, good))
    assert env.recv.metrics.drops == Counter({DropReason.DUPLICATE: 1})
    assert env.written_exactly({6})


def test_too_many_frames_are_malformed():
    """More frames than any batch may carry are dropped before the MAC is checked."""
    env = Env()
    env.reserve()
    sealed = env.send.seal(env.recv.endpoint, _batch())
    env.send.send_raw(env.recv.endpoint, [sealed[0], *[b"x"] * (MAX_BATCH_BLOCKS + 1), sealed[-1]])
    assert env.recv.metrics.drops == Counter({DropReason.MALFORMED: 1})
    _ship_batch(env)
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_over_zmq_moves_bit_exactly_and_is_sent(dtype):
    """Over TCP a batch lands bit-exactly in its reserved blocks only, and is_sent turns true."""
    src, dst, recv, send = zmq_case._pair("tcp", dtype)
    before = dst.clone()
    try:
        zmq_case._connect(send, recv)
        recv.register(Reservation("x1", zmq_case.DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        indices = list(range(1, 6))
        send.send_blocks("x1", indices, [zmq_case.DST_IDS[i] for i in indices], src,
                         [zmq_case.SRC_IDS[i] for i in indices])
        send.commit("x1", 777, zmq_case.NUM_TOKENS)
        (ev,) = zmq_case._events(recv)
        assert isinstance(ev, TransferCommitted) and ev.dst_block_ids == zmq_case.DST_IDS
        assert zmq_case._written_exactly(dst, before, src)
        assert recv.metrics.drops == Counter()
        zmq_case._until(recv, lambda: send.is_sent("x1"))
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("cap", [OLD_ACK_BATCH_BYTES, 16 << 20])
def test_call_of_several_messages_lands_and_is_sent(cap):
    """20 blocks of 0.5 MiB leave as 3 messages (8 + 8 + 4) under a 4 MiB cap, or as one of
    20 under a 16 MiB one (each frame still within the receiver's one-block MAXMSGSIZE),
    zero-copy, the last one tracked: every block lands bit-exactly and is_sent turns true."""
    geom = dict(num_blocks=20, num_layers=8, block_size=16, num_kv_heads=8, head_dim=64)
    src, dst = make_pool(seed=1, **geom), make_pool(seed=None, **geom)
    recv = zmq_case.ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET, "tcp://127.0.0.1:*",
                                max_batch_bytes=cap)
    send = zmq_case.ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, max_batch_bytes=cap)
    try:
        zmq_case._connect(send, recv)
        ids = list(range(20))
        recv.register(Reservation("x1", tuple(ids[::-1])))
        send.begin("x1", recv.endpoint)
        send.send_blocks("x1", ids, ids[::-1], src, ids)
        send.commit("x1", 1, 20 * 16)
        events = zmq_case._events(recv)
        assert [type(e) for e in events] == [TransferCommitted], (events, recv.metrics)
        assert all(same_bytes(dst[19 - i], src[i]) for i in ids)
        zmq_case._until(recv, lambda: send.is_sent("x1"))
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("batched", [False, True])
def test_a_failed_first_write_fails_its_transfer_at_once(batched, monkeypatch):
    """The sink fails the first write of a transfer (not yet claimed: mark_written claims): the
    transfer fails with CHANNEL_BROKEN at once, not at its lease's end, and the peer is dropped."""
    env = Env()
    env.reserve()
    sink = env.recv._core._sink
    broken = lambda *a: (_ for _ in ()).throw(RuntimeError("link down"))   # noqa: E731
    monkeypatch.setattr(sink, "write_many" if batched else "write", broken)
    if batched:
        _ship_batch(env, commit=False)
    else:
        env.ship(indices=(1,), commit=False)
    env.run(1.0)
    assert [(type(e), e.xfer_id, e.reason) for e in env.events] == [(TransferFailed, "x1", FailReason.CHANNEL_BROKEN)]
    assert env.recv.ledger.live_xfers() == [] and env.recv.metrics.blocks_written == 0
