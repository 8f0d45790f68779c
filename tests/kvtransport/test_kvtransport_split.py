"""Split payloads: a batch's [header, seal] as one message, then each payload as a message of its
own on the same connection (negotiated in the HelloAck). Both forms land the same bytes; a sender
keeps the one-message form with a receiver that does not announce the split; a missing, extra,
short, long or interleaved payload message, or a split seal that does not verify, is dropped and
counted, leaves no slot owed and no block marked written, and a concurrent good peer's transfer
commits bit-exactly meanwhile."""
from collections import Counter

import pytest
import torch
import time

from kvtransport.events import FailReason, TransferCommitted, TransferFailed
from kvtransport.metrics import DropReason
from kvtransport.payload import BlockWriterSink
from kvtransport.receiver_state import Reservation
from kvtransport.session import SEQ_LEN
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_sender import ZmqSender
from pdwire.messages import BATCH_BYTES, WHOLE_BATCH_BYTES, Heartbeat, encode
from tests.kvtransport.test_kvtransport_zmq import (DST_IDS, GEOM, NUM_TOKENS, SRC_IDS, _connect, _events, _pair,
                                                    _until, _written_exactly)

pytestmark = pytest.mark.timeout(60)

GOOD_DST, GOOD_SRC = (1, 2, 4, 6, 8, 10), (7, 8, 9, 10, 11, 12)     # x2, the concurrent good peer's


def _recorded(send, monkeypatch) -> list[list]:
    """Every message send's link sends from now on, as its list of frames (send_each's: one a frame)."""
    sent = []
    monkeypatch.setattr(send._link, "send", lambda ep, frames: sent.append(frames) or
                        type(send._link).send(send._link, ep, frames))
    monkeypatch.setattr(send._link, "send_each", lambda ep, frames: sent.extend([f] for f in frames) or
                        type(send._link).send_each(send._link, ep, frames))
    return sent


@pytest.mark.parametrize("recv_split, send_split", [(True, True), (False, True), (True, False)])
def test_both_forms_land_the_same_bytes_and_both_ends_decide(recv_split, send_split, monkeypatch):
    """A receiver built with split_payloads gets [header, seal] and one bare message per payload
    from a sender that splits; one built without gets every payload in its header's message, in
    batches of WHOLE_BATCH_BYTES at most (they are copied cold past it); a sender that does not
    split (a KV move's) to a receiver that does sends one block a message: that receiver's queue
    is counted in messages of one payload (ZeroMQ counts messages), so whole batches would let it
    queue WHOLE_BATCH_BYTES / a block times its byte limit; every form commits bit-exactly."""
    src, dst, recv, send = _pair("tcp", split_payloads=recv_split)
    split = recv_split and send_split
    if not send_split:
        send.close()
        send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET, split_payloads=False)
    before = dst.clone()
    try:
        _connect(send, recv)
        assert send._core.splits(recv.endpoint) is split
        whole = 1 if recv_split else WHOLE_BATCH_BYTES
        assert send._core.batch_bytes(recv.endpoint) == (BATCH_BYTES if split else whole)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        send.begin("x1", recv.endpoint)
        sent = _recorded(send, monkeypatch)
        send.send_block("x1", 1, DST_IDS[1], src, SRC_IDS[1])
        send.send_blocks("x1", [2, 3, 4, 5], list(DST_IDS[2:]), src, list(SRC_IDS[2:]))
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter()
        assert _written_exactly(dst, before, src) and recv._core._owed == {}
        shapes = [len(f) for f in sent]    # send_tracked's last message goes through send too
        assert shapes == ([2, 1, 2, 1, 1, 1, 1, 2] if split else [3] * 5 + [2] if recv_split else [3, 6, 2])
    finally:
        send.close()
        recv.close()


def test_a_receiver_without_slots_does_not_announce_the_split():
    """A pool the bytes cannot go straight into (a sink without slots, e.g. tensor parallel's)
    keeps the one-message form, in batches of WHOLE_BATCH_BYTES at most."""
    layout = make_identity(make_pool(**GEOM), "d0").layout
    src, dst, recv, send = _pair("tcp", sink=BlockWriterSink(lambda ids, blocks: None, layout))
    try:
        _connect(send, recv)
        assert not send._core.splits(recv.endpoint)
        assert send._core.batch_bytes(recv.endpoint) == WHOLE_BATCH_BYTES < BATCH_BYTES
    finally:
        send.close()
        recv.close()


def _split_header(send, ep, header, declared, flip=False, split=True):
    """[header, seal] sealed on send's session with ep, declaring payloads of `declared` bytes."""
    hdr = encode(header)
    seal = send._core._links[ep].session.seal_first(hdr, declared, split)
    if flip:
        seal = seal[:SEQ_LEN] + bytes([seal[SEQ_LEN] ^ 1]) + seal[SEQ_LEN + 1:]
    return [hdr, seal]


def _bad_sequence(kind, send, ep, src):
    """(messages before, messages after the good peer ships, expected drops, blocks it wrote) of
    x1's blocks 1 and 2 sent badly by send, with payloads of 0xEE bytes ("extra": the two real
    blocks, which land, and a third payload message)."""
    header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
    n = header.nbytes
    p = bytes(torch.full((n,), 0xEE, dtype=torch.uint8).numpy())
    head = _split_header(send, ep, header, [n, n])
    beat = send._core.pack(ep, Heartbeat(send._core.identity.epoch, ("x1",)))
    real = send._channel.inline_many(src, [SRC_IDS[1], SRC_IDS[2]])
    nb, mal, mac = DropReason.BAD_NBYTES, DropReason.MALFORMED, DropReason.BAD_MAC
    return {
        "missing": ([head, [p]], [], {nb: 1}, 0),                  # cut short by the resend's header
        "extra": ([head, [real[0]]], [[real[1]], [p]], {mal: 1}, 2),
        "short": ([head, [p]], [[p[:-1]]], {nb: 1}, 0),
        "long": ([head, [p]], [[p + bytes(64)]], {nb: 1}, 0),     # too long: nothing of it lands
        "interleaved": ([head, [p]], [beat, [p]], {nb: 1, mal: 1}, 0),
        "bad MAC": ([_split_header(send, ep, header, [n, n], flip=True), [p]], [[p]], {mac: 1, mal: 2}, 0),
        "one-message seal alone": ([_split_header(send, ep, header, [n, n], split=False), [p]], [[p]],
                                   {mac: 1, mal: 2}, 0),
        "split seal with payloads": ([[*head, p, p]], [], {mac: 1}, 0),
    }[kind]


@pytest.mark.parametrize("kind", ["missing", "extra", "short", "long", "interleaved", "bad MAC",
                                  "one-message seal alone", "split seal with payloads"])
def test_a_bad_split_sequence_is_dropped_and_a_concurrent_peer_is_unharmed(kind):
    """One peer sends x1's blocks 1-2 as a bad split sequence, in two parts around a good peer's
    whole transfer x2: the good transfer commits bit-exactly, the bad sequence is dropped and
    counted (exactly the expected drops), nothing stays owed, no block of x1 counts as written
    (a payload of the wrong size writes nothing; one of the right size may land in that peer's own reserved slots),
    and the bad peer's resend of every block then commits x1 bit-exactly."""
    src, dst, recv, send = _pair("tcp")
    good = ZmqSender(make_identity(src, "p1", "zmq"), TEST_SECRET)
    before, ep = dst.clone(), recv.endpoint
    try:
        _connect(send, recv)
        _connect(good, recv)
        recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
        recv.register(Reservation("x2", GOOD_DST))
        send.begin("x1", ep)
        good.begin("x2", ep)
        first, second, drops, landed = _bad_sequence(kind, send, ep, src)
        for message in first:
            send._link.send(ep, message)
        good.send_blocks("x2", list(range(6)), list(GOOD_DST), src, list(GOOD_SRC))
        good.commit("x2", 5, 90)
        for message in second:
            send._link.send(ep, message)
        so_far = Counter() if kind == "missing" else Counter(drops)    # "missing": seen once the resend comes
        events = _until(recv, lambda: recv.metrics.drops == so_far and recv.metrics.transfers_committed == 1)
        assert [e.xfer_id for e in events] == ["x2"] and isinstance(events[0], TransferCommitted)
        assert all(same_bytes(dst[d], src[s]) for d, s in zip(GOOD_DST, GOOD_SRC))
        assert recv.metrics.blocks_written == 6 + landed
        ids = [1, 2, 3, 4, 5][landed:]
        send.send_blocks("x1", ids, [DST_IDS[i] for i in ids], src, [SRC_IDS[i] for i in ids])
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and ev.xfer_id == "x1"
        assert recv.metrics.drops == Counter(drops) and recv.metrics.blocks_written == 11
        assert _written_exactly(dst, _with(before, GOOD_DST, GOOD_SRC, src), src)
        assert recv._core._owed == {}
    finally:
        good.close()
        send.close()
        recv.close()


def _with(before, dsts, srcs, src):
    """before with blocks dsts holding src's blocks srcs (the good peer's transfer)."""
    out = before.clone()
    for d, s in zip(dsts, srcs):
        out[d] = src[s]
    return out


def _owing_blocks_1_and_2(send, recv, src):
    """Pair send with recv, reserve x1 and send [header, seal] of its blocks 1 and 2 split: once
    recv owes them, the header."""
    _connect(send, recv)
    recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
    send.begin("x1", recv.endpoint)
    header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
    send._link.send(recv.endpoint, _split_header(send, recv.endpoint, header, [header.nbytes] * 2))
    _until(recv, lambda: recv._core._owed != {})
    return header


def test_payloads_owed_to_a_transfer_that_ended_are_dropped():
    """The receiver aborts x1 between its split header and payloads: the owed batch is dropped
    once (FINISHED_XFER), its payloads are extras (MALFORMED), nothing is written or owed."""
    src, dst, recv, send = _pair("tcp")
    before, ep = dst.clone(), recv.endpoint
    try:
        header = _owing_blocks_1_and_2(send, recv, src)
        recv.abort("x1", "test")
        for _ in range(2):
            send._link.send(ep, [bytes(header.nbytes)])
        events = _until(recv, lambda: recv.metrics.drops == Counter({DropReason.FINISHED_XFER: 1,
                                                                      DropReason.MALFORMED: 2}))
        assert [type(e) for e in events] == [TransferFailed] and events[0].reason is FailReason.LOCAL_ABORT
        assert recv._core._owed == {} and recv.metrics.blocks_written == 0 and dst.equal(before)
    finally:
        send.close()
        recv.close()


def test_a_wait_for_owed_payloads_ends_within_max_poll_s():
    """While a peer owes a split batch payloads, the link waits for them for what is left of
    max_poll_s (10 ms here), never of the call's own (60 s): a receive returns with one payload of
    two taken, still owed, and the second completes the batch."""
    src, dst, recv, send = _pair("tcp", max_poll_s=0.010)
    before, ep = dst.clone(), recv.endpoint
    try:
        header = _owing_blocks_1_and_2(send, recv, src)
        (owed,) = recv._core._owed.values()
        first, second = send._channel.inline_many(src, [SRC_IDS[1], SRC_IDS[2]])
        send._link.send(ep, [first])
        start = time.monotonic()
        recv._link.receive(60.0)
        assert time.monotonic() - start < 30.0         # the call's own timeout would be 60 s
        assert owed.sizes == [header.nbytes] and recv._core._owed != {}
        send._link.send(ep, [second])
        send.send_blocks("x1", [3, 4, 5], list(DST_IDS[3:]), src, list(SRC_IDS[3:]))
        send.commit("x1", 777, NUM_TOKENS)
        (ev,) = _events(recv)
        assert isinstance(ev, TransferCommitted) and recv.metrics.drops == Counter()
        assert _written_exactly(dst, before, src) and recv._core._owed == {}
    finally:
        send.close()
        recv.close()


def test_send_each_sends_every_frame_as_a_message_of_its_own_in_order():
    """SendLink.send_each (a split batch's payloads): one message a frame, in order, each under the
    link's own send (so a fake link's fault plan counts each); none for no frames."""
    from kvtransport.fake_link import FakeNetwork, FakeReceiveLink, FakeSendLink, FaultPlan
    network, got = FakeNetwork(), []
    receiver = FakeReceiveLink(network, "d0")
    receiver.bind(lambda peer, frames: got.append((peer, [bytes(f) for f in frames])))
    sender = FakeSendLink(network, "p0", FaultPlan(drop=frozenset({1})))
    sender.open(receiver.endpoint)
    sender.paired(receiver.endpoint)
    sender.send_each(receiver.endpoint, [])
    sender.send_each(receiver.endpoint, [b"a", memoryview(b"bc"), b"d"])
    assert got == [("p0", [b"a"]), ("p0", [b"d"])]      # the second message dropped by the plan
