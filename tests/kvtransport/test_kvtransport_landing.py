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
from kvtransport.session import SEQ_LEN, TRAILER_LEN
from pdwire.messages import encode
from tests.kvtransport.test_kvtransport_zmq import (DST_IDS, NUM_TOKENS, SRC_IDS, _connect, _events, _pair,
                                                    _until, _written_exactly)

pytestmark = pytest.mark.timeout(60)


def _setup(split=False):
    """A paired sender and receiver with x1 reserved; split: the sender sends payloads as messages
    of their own (as the receiver announced, by default), else as frames of their header's message
    to a receiver that does not split (one that does takes a whole message of one block at most)."""
    src, dst, recv, send = _pair("tcp", split_payloads=split)
    _connect(send, recv)
    assert send._core.splits(recv.endpoint) is split
    recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
    send.begin("x1", recv.endpoint)
    return src, dst, recv, send


def _close(recv, send):
    send.close()
    recv.close()



def _send_five_and_commit(send, recv, src) -> None:
    """Block 1 alone, blocks 2-5 as one batch, then the commit; the transfer must commit cleanly."""
    send.send_block("x1", 1, DST_IDS[1], src, SRC_IDS[1])
    ids = [2, 3, 4, 5]
    send.send_blocks("x1", ids, [DST_IDS[i] for i in ids], src, [SRC_IDS[i] for i in ids])
    send.commit("x1", 777, NUM_TOKENS)
    (ev,) = _events(recv)
    assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter()

@pytest.mark.parametrize("split", [False, True])
def test_block_frames_and_batches_land_without_the_sink(split, monkeypatch):
    """BlockFrame and BlockBatch payloads go straight into the pool (one copy each), as frames of
    one message or (split) as messages of their own: the sink's own copy is never called, yet
    every block lands bit-exactly and the copy's time is counted."""
    src, dst, recv, send = _setup(split)
    before = dst.clone()
    monkeypatch.setattr(recv._core._sink, "write_many", lambda *a: pytest.fail("copied through the sink"))
    try:
        _send_five_and_commit(send, recv, src)
        assert _written_exactly(dst, before, src)
        assert recv.metrics.blocks_written == 5 and recv.metrics.write_seconds > 0
    finally:
        _close(recv, send)


def _sealed(send, ep, header, declared, payloads, flip_mac=False):
    """[header, seal, *payloads] from send's session with ep: a seal declaring `declared`."""
    hdr = encode(header)
    seal = send._core._links[ep].session.seal_first(hdr, declared)
    if flip_mac:
        seal = seal[:SEQ_LEN] + bytes([seal[SEQ_LEN] ^ 1]) + seal[SEQ_LEN + 1:]
    return [hdr, seal, *payloads]


def _bad(kind, header, block):
    """(header, declared lengths, payload frames) of a bad message of one kind, for blocks 1, 2 of x1."""
    n = header.nbytes
    return {
        "short payload": (header, [n, n], [block, block[:-1]]),
        "long payload": (header, [n, n], [block, bytes(block) + b"\x00" * 64]),     # too long: nothing of it lands
        "fewer payloads": (header, [n, n], [block]),
        "more payloads": (header, [n, n], [block, block, block]),
        "declared lengths": (header, [n, n - 8], [block, block[:-8]]),       # the seal's, not the header's
        "header nbytes": (replace(header, nbytes=n - 8), [n - 8] * 2, [block[:-8]] * 2),
        "unreserved": (replace(header, block_ids=(DST_IDS[1], 1)), [n, n], [block, block]),   # 1: not x1's
    }[kind]


def _send_bad(send, ep, src, kind) -> None:
    """x1's blocks 1 and 2 as a bad BlockBatch of one kind (_bad's, or "bad MAC"), 0xEE bytes."""
    header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
    garbage = memoryview(torch.full((header.nbytes,), 0xEE, dtype=torch.uint8).numpy())
    n = header.nbytes
    if kind == "bad MAC":
        send._link.send(ep, _sealed(send, ep, header, [n, n], [garbage, garbage], flip_mac=True))
    else:
        bad_header, declared, payloads = _bad(kind, header, garbage)
        send._link.send(ep, _sealed(send, ep, bad_header, declared, payloads))


@pytest.mark.parametrize("kind, reason, direct", [
    ("short payload", DropReason.BAD_NBYTES, True),
    ("long payload", DropReason.BAD_NBYTES, True),
    ("fewer payloads", DropReason.BAD_NBYTES, True),
    ("more payloads", DropReason.BAD_NBYTES, True),
    ("declared lengths", DropReason.BAD_NBYTES, False),
    ("header nbytes", DropReason.BAD_NBYTES, False),
    ("unreserved", DropReason.NOT_RESERVED, False),
    ("bad MAC", DropReason.BAD_MAC, False),
    ("replay", DropReason.REPLAY, False),          # its first copy lands: received into the slots
])
def test_bad_batch_from_a_paired_peer_is_dropped_and_the_transfer_commits(kind, reason, direct, monkeypatch):
    """A BlockBatch [header, seal, payload*] from the paired sender with payload frames that do
    not match the lengths its seal declares (short, long, missing, extra), declared lengths or a
    header that do not match the layout or the reservation, a wrong MAC, or a replay: dropped
    once with its reason, no block is counted written, and the real blocks then commit.
    `direct`: its seal verified, so its payloads went into the slots before the drop (bytes of
    the authenticated peer, in its own reserved blocks only); every other one wrote no byte at
    all into the pool: the MAC and every check come before the first payload byte."""
    src, dst, recv, send = _setup()
    before = dst.clone()
    core, landed = recv._core, []
    monkeypatch.setattr(core, "landed", lambda *a: landed.append(a[2]) or type(core).landed(core, *a))
    try:
        ep = recv.endpoint
        if kind == "replay":
            header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
            garbage = memoryview(torch.full((header.nbytes,), 0xEE, dtype=torch.uint8).numpy())
            frames = send._core.pack(ep, header, *send._channel.inline_many(src, [SRC_IDS[1], SRC_IDS[2]]))
            assert len(frames[1]) == TRAILER_LEN + 16         # the seal, with the two lengths
            send._link.send(ep, frames)
            assert _until(recv, lambda: recv.metrics.blocks_written == 2) == []
            before = dst.clone()
            send._link.send(ep, [*frames[:2], garbage, garbage])      # same seal, other bytes
        else:
            _send_bad(send, ep, src, kind)
        assert _until(recv, lambda: recv.metrics.drops == Counter({reason: 1})) == []
        assert recv.metrics.blocks_written == (2 if kind == "replay" else 0)
        assert len(landed) == (kind == "replay") + direct
        if direct:
            assert same_outside(dst, before, {DST_IDS[1], DST_IDS[2]})
        else:
            assert dst.equal(before)         # every byte of the pool, reserved blocks included
        indices = range(3 if kind == "replay" else 1, 6)
        ids = list(indices)
        send.send_blocks("x1", ids, [DST_IDS[i] for i in ids], src, [SRC_IDS[i] for i in ids])
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and recv.metrics.blocks_written == 5
        assert _written_exactly(dst, before, src)
        assert recv.metrics.drops == Counter({reason: 1})
    finally:
        _close(recv, send)


def same_outside(dst, before, touched):
    return all(dst[b].equal(before[b]) for b in range(dst.shape[0]) if b not in touched)


@pytest.mark.parametrize("split", [False, True])
def test_layer_slices_land_in_their_layers_only(split, monkeypatch):
    """A LayerBatch lands straight in its layers of each block (either form); the block's
    other layers keep their bytes until their own slices come."""
    src, dst, recv, send = _setup(split)
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


@pytest.mark.parametrize("old", ["sender", "receiver"])
def test_payloads_first_either_way_transfer_bit_exactly(old, monkeypatch):
    """A sender from before the seal (it ignores the HelloAck's sealed_first) with this receiver,
    and this sender with a receiver that does not announce the seal: every payload message goes
    [header, payload*, trailer], the receiver takes it whole (nothing lands before its MAC is
    checked), and the transfer commits bit-exactly. (An older sender pairs only with a receiver
    that does not split: it cannot read the split's HelloAck; README, Upgrading.)"""
    src, dst, recv, send = _pair("tcp", split_payloads=old == "receiver")
    before, landed, sent = dst.clone(), [], []
    if old == "receiver":
        recv._core.sealed_first = False
    monkeypatch.setattr(recv._core, "landed", lambda *a: landed.append(a))
    monkeypatch.setattr(send._link, "send", lambda ep, frames: sent.append(frames) or
                        type(send._link).send(send._link, ep, frames))
    try:
        _connect(send, recv)
        if old == "sender":
            send._core._links[recv.endpoint].sealed_first = False
            send._core._links[recv.endpoint].split = False       # it knows neither
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        _send_five_and_commit(send, recv, src)
        assert _written_exactly(dst, before, src) and landed == []
        with_payloads = [f for f in sent if len(f) > 2]
        assert len(with_payloads) == 2 and all(len(f[-1]) == TRAILER_LEN for f in with_payloads)
    finally:
        _close(recv, send)


@pytest.mark.parametrize("kind", ["bad MAC", "unreserved"])
def test_a_header_landing_decoded_is_not_decoded_again(kind, monkeypatch):
    """A message that landing() decodes and then leaves to handle() (its seal's MAC fails, a
    block is not the transfer's) has its header decoded once, not twice, and is still dropped
    once with its reason; the transfer then commits."""
    src, dst, recv, send = _setup()
    before, core, decoded = dst.clone(), recv._core, []
    decode = core._framer._decode
    monkeypatch.setattr(core._framer, "_decode", lambda buf: decoded.append(bytes(buf)) or decode(buf))
    try:
        _send_bad(send, recv.endpoint, src, kind)
        reason = {"bad MAC": DropReason.BAD_MAC, "unreserved": DropReason.NOT_RESERVED}[kind]
        assert _until(recv, lambda: recv.metrics.drops == Counter({reason: 1})) == []
        assert len(decoded) == 1 and dst.equal(before)
        _send_five_and_commit_after_drop(send, recv, src, reason)
        assert _written_exactly(dst, before, src)
    finally:
        _close(recv, send)


def _send_five_and_commit_after_drop(send, recv, src, reason) -> None:
    ids = [1, 2, 3, 4, 5]
    send.send_blocks("x1", ids, [DST_IDS[i] for i in ids], src, [SRC_IDS[i] for i in ids])
    send.commit("x1", 777, NUM_TOKENS)
    (ev,) = _events(recv)
    assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter({reason: 1})


def test_a_sinks_slots_are_the_blocks_bytes_whole_or_a_layer_range():
    """InlineSink.slots (whole blocks from views made once, layer ranges sliced per call): bytes
    written into slot k land in pool block dsts[k], in its layers first_layer.., nothing else changes."""
    from kvtransport.payload import InlineSink
    from kvtransport.testing import make_identity, make_pool
    pool = make_pool(num_blocks=6, num_layers=4, seed=None)
    sink = InlineSink(pool, make_identity(pool, "d").layout)
    nbytes = pool[0].numel() * pool.element_size()
    for dsts, first, layers in (((4, 1, 5), 0, 4), ((2, 0), 1, 2), ((3,), 3, 1)):
        pool.zero_()
        slots = sink.slots(dsts, first, nbytes // 4 * layers)
        for k, slot in enumerate(slots):
            slot[:] = bytes([k + 1]) * len(slot)
        raw = pool.view(torch.uint8).view(6, 4, -1)     # [block, layer, bytes of one layer]
        for b in range(6):
            want = torch.zeros_like(raw[b])
            if b in dsts:
                want[first:first + layers] = dsts.index(b) + 1
            assert torch.equal(raw[b], want), (dsts, first, b)


def test_a_sinks_slot_past_the_pool_is_empty_not_an_error():
    """A block id at or past the pool (the ledger never lets one through) gets an empty view, which
    the copy refuses as a wrong size, never an IndexError that would end the receive loop."""
    from kvtransport.payload import InlineSink
    from kvtransport.testing import make_identity, make_pool
    pool = make_pool(num_blocks=6, num_layers=4, seed=None)
    sink = InlineSink(pool, make_identity(pool, "d").layout)
    nbytes = pool[0].numel() * pool.element_size()
    slots = sink.slots([2, 6], 0, nbytes)
    assert [len(s) for s in slots] == [nbytes, 0]
    assert sink.slots([], 0, nbytes) == []
