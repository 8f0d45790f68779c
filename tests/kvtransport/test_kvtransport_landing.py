"""Payload frames received straight into their pool slots (ZmqReceiveLink + ReceiverCore.landing):
one copy, no copy through the sink, and a bad message from an authenticated peer is dropped,
counted and leaves no block marked written, while the good transfer commits bit-exactly."""
from collections import Counter
from dataclasses import replace

import pytest
import torch

from kvtransport.events import TransferCommitted
from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from tests.kvtransport.test_kvtransport_zmq import (DST_IDS, NUM_TOKENS, SRC_IDS, _connect, _events, _pair,
                                                    _until, _written_exactly)

pytestmark = pytest.mark.timeout(60)


def _setup():
    src, dst, recv, send = _pair("tcp")
    _connect(send, recv)
    recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
    send.begin("x1", recv.endpoint)
    return src, dst, recv, send


def _close(recv, send):
    send.close()
    recv.close()


def test_block_frames_and_batches_land_without_the_sink(monkeypatch):
    """BlockFrame and BlockBatch payloads go into the pool by recv_into: the sink's own copy is
    never called, yet every block lands bit-exactly and the copy's time is counted."""
    src, dst, recv, send = _setup()
    before = dst.clone()
    monkeypatch.setattr(recv._core._sink, "write_many", lambda *a: pytest.fail("copied through the sink"))
    try:
        send.send_block("x1", 1, DST_IDS[1], src, SRC_IDS[1])
        ids = [2, 3, 4, 5]
        send.send_blocks("x1", ids, [DST_IDS[i] for i in ids], src, [SRC_IDS[i] for i in ids])
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter()
        assert _written_exactly(dst, before, src)
        assert recv.metrics.blocks_written == 5 and recv.metrics.write_seconds > 0
    finally:
        _close(recv, send)


def _bad(kind, header, block):
    """(header, payload frames) of a bad message of one kind, for blocks 1 and 2 of x1."""
    two = [block, block]
    return {
        "short payload": (header, [block, block[:-1]]),
        "long payload": (header, [block, bytes(block) + b"\x00" * 64]),        # cut to its slot
        "header nbytes": (replace(header, nbytes=header.nbytes - 8), two),     # no landing: whole
        "fewer payloads": (header, [block]),                                   # trailer in a slot
        "more payloads": (header, [block, block, block]),
        "unreserved": (replace(header, block_ids=(DST_IDS[1], 1)), two),      # block 1: not x1's
    }[kind]


@pytest.mark.parametrize("kind, reason, direct", [
    ("short payload", DropReason.BAD_NBYTES, True),
    ("long payload", DropReason.BAD_NBYTES, True),
    ("header nbytes", DropReason.BAD_NBYTES, False),
    ("fewer payloads", DropReason.BAD_NBYTES, True),
    ("more payloads", DropReason.BAD_NBYTES, True),
    ("unreserved", DropReason.NOT_RESERVED, False),
    ("bad MAC", DropReason.BAD_MAC, True),
    ("replay", DropReason.REPLAY, False),          # its blocks are written: received whole
])
def test_bad_batch_from_a_paired_peer_is_dropped_and_the_transfer_commits(kind, reason, direct, monkeypatch):
    """A sealed BlockBatch from the paired sender with a payload frame that does not match its
    header (short, long, missing, extra), a header that does not match the layout or the
    reservation, a wrong MAC, or a replay: dropped once with its reason, no block is counted
    written, nothing outside the reserved blocks changes, and the real blocks then commit.
    `direct`: its payloads went into the slots (the header passed every check) before the drop."""
    src, dst, recv, send = _setup()
    before = dst.clone()
    core, landed = recv._core, []
    monkeypatch.setattr(core, "landed", lambda *a: landed.append(a[2]) or type(core).landed(core, *a))
    try:
        ep = recv.endpoint
        header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
        garbage = memoryview(torch.full((header.nbytes,), 0xEE, dtype=torch.uint8).numpy())
        if kind == "bad MAC":
            *frames, trailer = send._core.pack(ep, header, garbage, garbage)
            send._link.send(ep, [*frames, trailer[:-1] + bytes([trailer[-1] ^ 1])])
        elif kind == "replay":
            frames = send._core.pack(ep, header, *send._channel.inline_many(src, [SRC_IDS[1], SRC_IDS[2]]))
            send._link.send(ep, frames)
            assert _until(recv, lambda: recv.metrics.blocks_written == 2) == []
            send._link.send(ep, [*frames[:-3], garbage, garbage, frames[-1]])     # same sizes, same MAC
        else:
            bad_header, payloads = _bad(kind, header, garbage)
            send._link.send(ep, send._core.pack(ep, bad_header, *payloads))
        assert _until(recv, lambda: recv.metrics.drops == Counter({reason: 1})) == []
        assert recv.metrics.blocks_written == (2 if kind == "replay" else 0)
        assert len(landed) == (kind == "replay") + direct
        assert same_outside(dst, before, {DST_IDS[1], DST_IDS[2]})
        indices = range(3 if kind == "replay" else 1, 6)
        ids = list(indices)
        send.send_blocks("x1", ids, [DST_IDS[i] for i in ids], src, [SRC_IDS[i] for i in ids])
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and recv.metrics.blocks_written == 5
        assert _written_exactly(dst, before, src) and recv.metrics.drops == Counter({reason: 1})
    finally:
        _close(recv, send)


def same_outside(dst, before, touched):
    return all(dst[b].equal(before[b]) for b in range(dst.shape[0]) if b not in touched)


def test_layer_slices_land_in_their_layers_only(monkeypatch):
    """A LayerBatch lands by recv_into in its layers of each block; the block's other layers
    keep their bytes until their own slices come."""
    src, dst, recv, send = _setup()
    before = dst.clone()
    monkeypatch.setattr(recv._core._sink, "write_many", lambda *a: pytest.fail("copied through the sink"))
    try:
        ids = [1, 2, 3, 4, 5]
        dst_ids, src_ids = [DST_IDS[i] for i in ids], [SRC_IDS[i] for i in ids]
        send.send_layers("x1", ids, dst_ids, src, src_ids, 1, 1)
        assert _until(recv, lambda: recv.metrics.bytes_written == 5 * dst[0, 1].numel() * 4) == []
        for d, s in zip(dst_ids, src_ids):
            assert dst[d, 1].equal(src[s, 1]) and dst[d, 0].equal(before[d, 0])
        send.send_layers("x1", ids, dst_ids, src, src_ids, 0, 1)
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and _written_exactly(dst, before, src)
    finally:
        _close(recv, send)
