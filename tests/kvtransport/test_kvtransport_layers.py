"""LayerBatch: a layer group's slices of blocks travel as soon as a forward finishes them; a block
counts as arrived only once every one of its layers has, and a bad batch is dropped whole."""
from collections import Counter

import pytest
import torch

from kvtransport.base import TransportError
from kvtransport.events import TransferCommitted
from kvtransport.fake import FakeNetwork, FakeReceiver, FakeSender, ManualClock
from kvtransport.metrics import DropReason
from kvtransport.payload import BlockWriterSink
from kvtransport.payload_channel import InlineChannel
from kvtransport.receiver_state import Reservation
from kvtransport.state import TransferState
from kvtransport.testing import TEST_SECRET, make_identity, make_pool
from pdwire.messages import LayerBatch
from tests.kvtransport.test_kvtransport_fake import DST_IDS, SHIPPED, SRC_IDS, Env
from tests.kvtransport import test_kvtransport_zmq as zmq_case

SLICE = 512                     # one layer of make_pool's default block (2 layers, 1024 bytes)
SLICE_SHAPE = (1, 2, 4, 2, 8)


def _layers(env, first, indices=(1, 2, 3)):
    env.send.send_layers("x1", list(indices), [DST_IDS[i] for i in indices], env.src,
                         [SRC_IDS[i] for i in indices], first, 1)


def _slice(env, index, first):
    """Layer `first` of block `index` of the sender's pool, as raw bytes."""
    return env.src[SRC_IDS[index], first].contiguous().view(torch.uint8).view(-1).numpy().tobytes()


def _batch(**over):
    f = dict(xfer_id="x1", indices=(1, 2), block_ids=(6, 7), first_layer=0, nbytes=SLICE, dtype="float32",
             shape=SLICE_SHAPE)
    f.update(over)
    return LayerBatch(**f)


def test_a_block_arrives_once_all_its_layers_have():
    """Layer 0 of three blocks lands but completes none; layer 1 completes every block, the
    Commit commits the transfer once, and the blocks hold the sender's bytes exactly."""
    env = Env()
    env.reserve()
    assert env.send.takes_layers("x1")
    _layers(env, 0)
    assert env.recv.poll() == [] and env.recv.metrics.blocks_written == 0
    assert all(torch.equal(env.dst[DST_IDS[i], 0], env.src[SRC_IDS[i], 0]) for i in (1, 2, 3))
    assert env.recv.ledger.state("x1") is TransferState.TRANSFERRING
    _layers(env, 1)
    assert env.recv.metrics.blocks_written == 3
    env.send.commit("x1", first_token=42, num_tokens=14)
    (ev,) = env.recv.poll()
    assert ev == TransferCommitted("x1", 42, 14, DST_IDS, 3 * 1024, 0.0, 0.0)
    assert env.written_exactly(SHIPPED) and env.recv.metrics.drops == Counter()
    assert env.recv.metrics.blocks_written == 3 and env.send.metrics.blocks_sent == 3


def test_layer_slices_and_whole_blocks_mix():
    """Blocks of earlier chunks travel whole, the last chunk's in layer slices: all commit."""
    env = Env()
    env.reserve()
    env.send.send_blocks("x1", [1], [DST_IDS[1]], env.src, [SRC_IDS[1]])
    _layers(env, 0, (2, 3))
    _layers(env, 1, (2, 3))
    env.send.commit("x1", first_token=42, num_tokens=14)
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]
    assert env.written_exactly(SHIPPED)


@pytest.mark.parametrize("over, reason", [
    (dict(first_layer=1, shape=(2, 2, 4, 2, 8), nbytes=2 * SLICE), DropReason.BAD_SHAPE),   # past the last layer
    (dict(shape=(1, 2, 4, 4, 4)), DropReason.BAD_SHAPE),
    (dict(dtype="bfloat16"), DropReason.BAD_DTYPE),
    (dict(nbytes=SLICE + 8), DropReason.BAD_NBYTES),
    (dict(indices=(1, 0), block_ids=(6, 5)), DropReason.NOT_RESERVED),      # a cached block
    (dict(indices=(1, 2), block_ids=(6, 4)), DropReason.NOT_RESERVED),      # a wrong block
    (dict(xfer_id="nope"), DropReason.UNKNOWN_XFER),
])
def test_bad_layer_batch_is_dropped_whole_and_counted(over, reason):
    """A layer batch bad in one block or in its layers, dtype or bytes writes nothing, not even
    its good block's slice, counts one drop, and the transfer still commits afterwards."""
    env = Env()
    env.reserve()
    batch = _batch(**over)
    payloads = [b"\xab" * batch.nbytes] * 2
    env.send.send_raw(env.recv.endpoint, env.send.seal(env.recv.endpoint, batch, *payloads))
    assert env.recv.poll() == [] and env.recv.metrics.drops == Counter({reason: 1})
    assert env.written_exactly(set())
    _layers(env, 0)
    _layers(env, 1)
    env.send.commit("x1", first_token=42, num_tokens=14)
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted] and env.written_exactly(SHIPPED)


def test_short_payload_drops_the_layer_batch_whole():
    """A slice one byte short: BAD_NBYTES, and the other block's good slice is not written."""
    env = Env()
    env.reserve()
    frames = env.send.seal(env.recv.endpoint, _batch(), _slice(env, 1, 0), _slice(env, 2, 0)[:-1])
    env.send.send_raw(env.recv.endpoint, frames)
    assert env.recv.metrics.drops == Counter({DropReason.BAD_NBYTES: 1}) and env.written_exactly(set())


def test_a_layer_twice_or_a_whole_block_after_a_slice_is_a_duplicate():
    """Once layer 0 of block 1 arrived, another layer 0 of it, or the whole block, is a DUPLICATE
    dropped whole (block 2's good slice in the same batch is not written either)."""
    env = Env()
    env.reserve()
    _layers(env, 0, (1,))
    again = env.send.seal(env.recv.endpoint, _batch(), _slice(env, 1, 0), _slice(env, 2, 0))
    env.send.send_raw(env.recv.endpoint, again)
    env.send.send_blocks("x1", [1], [DST_IDS[1]], env.src, [SRC_IDS[1]])
    assert env.recv.metrics.drops == Counter({DropReason.DUPLICATE: 2})
    assert not env.dst[DST_IDS[2]].equal(env.src[SRC_IDS[2]]) and env.recv.metrics.blocks_written == 0


def test_a_receiver_that_spreads_heads_takes_no_slices():
    """A receiver whose sink takes whole blocks only (tensor parallelism) says so in its HelloAck:
    the sender does not offer slices, and a LayerBatch sent anyway is dropped as MALFORMED."""
    env = Env(connect=False)
    sink = BlockWriterSink(lambda ids, blocks: None, make_identity(env.dst, "d1").layout)
    recv = FakeReceiver(env.net, "d1", env.dst, make_identity(env.dst, "d1"), TEST_SECRET, sink=sink)
    send = FakeSender(env.net, make_identity(env.src, "p1"), TEST_SECRET)
    send.connect(recv.endpoint)
    recv.register(Reservation("x1", DST_IDS, 1))
    send.begin("x1", recv.endpoint)
    assert not send.takes_layers("x1")
    send.send_raw(recv.endpoint, send.seal(recv.endpoint, _batch(), _slice(env, 1, 0), _slice(env, 2, 0)))
    recv.poll()
    assert recv.metrics.drops == Counter({DropReason.MALFORMED: 1})


def test_layer_slices_over_zmq_land_bit_exactly():
    """Over TCP, layer slices of five blocks land in their reserved blocks only, commit once, and
    is_sent turns true."""
    src, dst, recv, send = zmq_case._pair("tcp")
    before = dst.clone()
    try:
        zmq_case._connect(send, recv)
        recv.register(Reservation("x1", zmq_case.DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        assert send.takes_layers("x1")
        indices = list(range(1, 6))
        dst_ids, src_ids = [zmq_case.DST_IDS[i] for i in indices], [zmq_case.SRC_IDS[i] for i in indices]
        for first in range(src.shape[1]):
            send.send_layers("x1", indices, dst_ids, src, src_ids, first, 1)
        send.commit("x1", 777, zmq_case.NUM_TOKENS)
        (ev,) = zmq_case._events(recv)
        assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter()
        assert zmq_case._written_exactly(dst, before, src)
        zmq_case._until(recv, lambda: send.is_sent("x1"))
    finally:
        send.close()
        recv.close()


@pytest.mark.parametrize("limit", [16 << 10, 5000])
def test_layer_batches_fit_a_limit_that_is_no_whole_number_of_blocks(limit):
    """12-layer blocks of 6 KiB, 3 layers a group: under a 16 KiB limit a sender packs ten 1.5 KiB
    slices (15 KiB), more than the two whole blocks (12 KiB) the limit holds; under 5000 bytes (less
    than a block) three slices. The receiver's cap is the announced bytes (a block at least), so
    every batch lands and the transfer commits with the sender's bytes."""
    n = 12
    net = FakeNetwork(ManualClock())
    src = make_pool(n, 12, 4, 2, 8, torch.float32, seed=1)
    dst = make_pool(n, 12, 4, 2, 8, torch.float32, seed=None)
    recv = FakeReceiver(net, "d0", dst, make_identity(dst, "d0"), TEST_SECRET, max_batch_bytes=limit)
    send = FakeSender(net, make_identity(src, "p0"), TEST_SECRET, max_batch_bytes=limit)
    send.connect(recv.endpoint)
    ids = list(range(n))
    recv.register(Reservation("x1", tuple(ids), 0, 30.0))
    send.begin("x1", recv.endpoint)
    for first in range(0, 12, 3):
        send.send_layers("x1", ids, ids, src, ids, first, 3)
    send.commit("x1", 1, n * 4)
    (ev,) = recv.poll()
    assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter()
    assert torch.equal(dst, src)


def test_a_receiver_refuses_a_batch_limit_out_of_range():
    dst = make_pool(4)
    for bad in (0, (256 << 20) + 1):
        with pytest.raises(ValueError, match="max_batch_bytes"):
            FakeReceiver(FakeNetwork(ManualClock()), "d0", dst, make_identity(dst, "d0"), TEST_SECRET, max_batch_bytes=bad)


def test_inline_channel_slices_blocks_and_layers_of_one_view():
    """InlineChannel.inline_many: whole blocks, or layers [first, first + n) of each, as views of
    the pool's bytes; a pool it cannot view (strided here, a device pool alike) ships whole
    blocks as host copies and refuses layer slices."""
    src = make_pool(seed=1, num_blocks=4, num_layers=4, block_size=4, num_kv_heads=2, head_dim=8)
    channel = InlineChannel()
    blocks = channel.inline_many(src, [2, 0])
    assert [bytes(b) for b in blocks] == [src[b].numpy().tobytes() for b in (2, 0)]
    (piece,) = channel.inline_many(src, [3], first_layer=1, num_layers=2)
    assert bytes(piece) == src[3, 1:3].numpy().tobytes()
    strided = src[::2]                          # blocks 0 and 2: each contiguous, the pool not
    assert [bytes(b) for b in channel.inline_many(strided, [1])] == [src[2].numpy().tobytes()]
    with pytest.raises(TransportError, match="contiguous CPU pool"):
        channel.inline_many(strided, [1], first_layer=0, num_layers=1)
