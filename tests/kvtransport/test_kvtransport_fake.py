"""Fake backend: exact receiver state after the happy path and after every injected failure."""
from collections import Counter

import pytest
import torch

from kvtransport.base import TransportError
from kvtransport.events import FailReason, TransferCommitted, TransferFailed
from kvtransport.fake import FakeNetwork, FakeReceiver, FakeSender, FaultPlan, ManualClock
from pdwire import messages
from pdwire.messages import BlockFrame, Commit
from kvtransport.metrics import DropReason
from kvtransport.payload import block_bytes
from kvtransport.receiver_state import Reservation
from kvtransport.state import TransferState
from kvtransport.session import AuthKind, auth_frame
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes

DST_IDS = (5, 6, 7, 2)        # the prompt's block table on D; block 5 is a cached prefix
SRC_IDS = (0, 1, 2, 3)        # the same blocks on P
SHIPPED = DST_IDS[1:]
LEASE, PEER_TIMEOUT = 15.0, 10.0   # a dead peer is noticed before its leases run out


class Env:
    """A decode pool + FakeReceiver and a prefill pool + connected FakeSender on one clock."""

    def __init__(self, faults=FaultPlan(), secret=TEST_SECRET, sender_secret="same", connect=True):
        self.clock = ManualClock()
        self.net = FakeNetwork(self.clock)
        self.src = make_pool(seed=1)
        self.dst = make_pool(seed=2)
        self.before = self.dst.clone()
        self.recv = FakeReceiver(self.net, "d0", self.dst, make_identity(self.dst, "d0"), secret,
                                 PEER_TIMEOUT)
        self.send = self.sender("p0", faults, secret if sender_secret == "same" else sender_secret)
        self.events = []
        if connect:
            self.send.connect(self.recv.endpoint)

    def sender(self, node_id, faults=FaultPlan(), secret=TEST_SECRET):
        return FakeSender(self.net, make_identity(self.src, node_id), secret, faults,
                          heartbeat_interval=1.0, peer_timeout=PEER_TIMEOUT)

    def reserve(self, xfer_id="x1", dst_ids=DST_IDS, cached=1, sender=None):
        self.recv.register(Reservation(xfer_id, dst_ids, cached, LEASE))
        (sender or self.send).begin(xfer_id, self.recv.endpoint)

    def ship(self, xfer_id="x1", indices=(1, 2, 3), commit=True, sender=None):
        sender = sender or self.send
        for i in indices:
            sender.send_block(xfer_id, i, DST_IDS[i], self.src, SRC_IDS[i])
        if commit:
            sender.commit(xfer_id, first_token=42, num_tokens=14)

    def run(self, seconds, step=1.0):
        """Advance the clock, both sides polling every step; collect receiver events."""
        sender_events = []
        for _ in range(int(seconds / step)):
            self.clock.advance(step)
            sender_events += self.send.poll()
            self.events += self.recv.poll()
        return sender_events

    def written_exactly(self, blocks):
        """blocks hold the sender's bytes; every other block of the pool is unchanged."""
        for b in range(self.dst.shape[0]):
            if b in blocks:
                assert same_bytes(self.dst[b], self.src[SRC_IDS[DST_IDS.index(b)]]), b
            else:
                assert same_bytes(self.dst[b], self.before[b]), b
        return True

    def raw(self, frame, payload=None, sender=None):
        """frame (and payload) sealed on the sender's own session, outside its transfer logic."""
        sender = sender or self.send
        sender.send_raw(self.recv.endpoint, sender.seal(self.recv.endpoint, frame, payload))


def _frame(**over):
    f = dict(xfer_id="x1", index=1, block_id=6, nbytes=1024, dtype="float32", shape=(2, 2, 4, 2, 8))
    f.update(over)
    return BlockFrame(**f)


def test_happy_path_commits_exact_blocks():
    """All shipped blocks land bit-exactly in their reserved blocks, one Committed event."""
    env = Env()
    env.reserve()
    env.ship()
    (ev,) = env.recv.poll()
    assert ev == TransferCommitted("x1", 42, 14, DST_IDS, 3 * 1024, 0.0, 0.0)
    assert env.written_exactly(SHIPPED)
    assert env.recv.ledger.state("x1") is TransferState.COMMITTED
    assert env.recv.metrics.blocks_written == 3 and env.recv.metrics.drops == Counter()
    assert env.run(30) == [] and env.events == []          # no second event, ever


def test_queued_transfer_is_kept_alive_by_heartbeats():
    """A begun transfer waiting far past its lease (prefill queue) stays live via heartbeats."""
    env = Env()
    env.reserve()
    assert env.run(LEASE * 10) == [] and env.events == []
    assert env.recv.ledger.state("x1") is TransferState.RESERVED
    env.ship()
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]


def test_dropped_block_never_commits_and_lease_expires():
    """A lost block: no commit; once the sender stops naming it the lease fails it, once."""
    env = Env(FaultPlan(drop=frozenset({1})))
    env.reserve()
    env.ship()                                   # message 1 (index 2 -> block 7) is lost
    assert env.recv.poll() == []
    assert env.recv.ledger.state("x1") is TransferState.TRANSFERRING
    sender_events = env.run(LEASE + 5)
    assert env.events == [TransferFailed("x1", FailReason.LEASE_EXPIRED, "no progress for 15.0s")]
    assert sender_events == []                   # already committed on P: nothing to report
    assert env.written_exactly({6, 2})
    assert env.recv.ledger.live_xfers() == [] and env.recv.metrics.transfers_failed == 1


def test_duplicate_frame_is_dropped_and_counted():
    """A duplicated block is written once: a copy of the message is a REPLAY (its sequence number
    was seen), the same block sealed again is a DUPLICATE."""
    env = Env(FaultPlan(duplicate=frozenset({0})))
    env.reserve()
    env.ship(commit=False)
    env.raw(_frame(index=1, block_id=6), bytes(block_bytes(env.src, 1)))
    env.send.commit("x1", first_token=42, num_tokens=14)
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]
    assert env.recv.metrics.drops == Counter({DropReason.REPLAY: 1, DropReason.DUPLICATE: 1})
    assert env.recv.metrics.blocks_written == 3 and env.written_exactly(SHIPPED)


def test_second_write_with_other_bytes_is_dropped():
    """A second frame for an already written block never overwrites it."""
    env = Env()
    env.reserve()
    env.ship(indices=(1,), commit=False)
    env.raw(_frame(), torch.full((1024,), 7, dtype=torch.uint8).numpy().tobytes())
    assert env.recv.metrics.drops == Counter({DropReason.DUPLICATE: 1})
    assert env.written_exactly({6})


def test_corrupt_header_is_dropped_never_written():
    """A corrupted header fails its MAC: dropped unread, the block is never written, the lease
    fails it."""
    env = Env(FaultPlan(corrupt=frozenset({0})))
    env.reserve()
    env.ship()
    assert env.recv.poll() == []
    assert env.recv.metrics.drops == Counter({DropReason.BAD_MAC: 1})
    assert env.written_exactly({7, 2})
    env.run(LEASE + 1)
    assert [e.reason for e in env.events] == [FailReason.LEASE_EXPIRED]


@pytest.mark.parametrize("frame, payload_len, reason", [
    (_frame(dtype="bfloat16"), 1024, DropReason.BAD_DTYPE),
    (_frame(shape=(2, 2, 4, 4, 4)), 1024, DropReason.BAD_SHAPE),
    (_frame(nbytes=2048), 1024, DropReason.BAD_NBYTES),
    (_frame(), 1000, DropReason.BAD_NBYTES),
    (_frame(), 1 << 20, DropReason.OVERSIZE),
    (_frame(xfer_id="nope"), 1024, DropReason.UNKNOWN_XFER),
    (_frame(index=0, block_id=5), 1024, DropReason.NOT_RESERVED),     # the cached prefix block
    (_frame(index=1, block_id=4), 1024, DropReason.NOT_RESERVED),     # not the reserved block
    (_frame(index=4, block_id=4), 1024, DropReason.NOT_RESERVED),     # past the block table
    (_frame(index=1, block_id=99), 1024, DropReason.NOT_RESERVED),    # outside the pool
    (_frame(), None, DropReason.MALFORMED),                           # no payload frame
])
def test_bad_frames_are_dropped_never_written(frame, payload_len, reason):
    """Each bad frame is dropped with its reason; no pool byte changes; the transfer still commits."""
    env = Env()
    env.reserve()
    payload = None if payload_len is None else b"\xab" * payload_len
    env.raw(frame, payload)
    assert env.recv.metrics.drops == Counter({reason: 1})
    assert env.written_exactly(set())
    env.ship()
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]
    assert env.written_exactly(SHIPPED)


def test_frames_from_unpaired_or_other_peer_are_dropped():
    """Only the peer that claimed a transfer may write it; peers without a session may write nothing."""
    env = Env()
    env.reserve()
    env.ship(indices=(1,), commit=False)                 # p0 claims x1
    stranger = env.sender("p9")                          # never connected: it cannot seal
    stranger.send_raw(env.recv.endpoint, [messages.encode(_frame(index=2, block_id=7)), b"\x00" * 1024, b"t" * 40])
    other = env.sender("p1")
    other.connect(env.recv.endpoint)
    env.raw(_frame(index=2, block_id=7), b"\x00" * 1024, sender=other)
    assert env.recv.metrics.drops == Counter({DropReason.NOT_AUTHENTICATED: 1, DropReason.WRONG_PEER: 1})
    assert env.written_exactly({6})


def test_reservation_bound_to_a_sender_node():
    """A reservation naming its prefill node refuses every other paired node, even first comers."""
    env = Env(connect=False)
    other = env.sender("p1")
    other.connect(env.recv.endpoint)
    env.send.connect(env.recv.endpoint)
    env.recv.register(Reservation("x1", DST_IDS, 1, LEASE, sender_node_id="p0"))
    other.begin("x1", env.recv.endpoint)
    env.ship(indices=(1,), commit=False, sender=other)
    env.send.begin("x1", env.recv.endpoint)
    env.ship()
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]
    assert env.recv.metrics.drops == Counter({DropReason.WRONG_PEER: 1})
    assert env.written_exactly(SHIPPED)


def test_cut_connection_fails_transfer_exactly_once():
    """Cut at message k: the receiver fails it as PEER_DEAD once, the sender likewise."""
    env = Env(FaultPlan(cut_at=2))
    env.reserve()
    env.ship()                                           # blocks 6, 7 arrive; 2 and Commit lost
    assert env.recv.poll() == []
    sender_events = env.run(PEER_TIMEOUT + LEASE + 5)
    assert env.events == [TransferFailed("x1", FailReason.PEER_DEAD, "silent for 10.0s")]
    assert sender_events == []                           # P committed x1 before the cut
    assert env.written_exactly({6, 7})


def test_cut_before_commit_reports_to_sender():
    """A sender whose receiver goes silent fails its open transfers once (PEER_DEAD)."""
    env = Env(FaultPlan(cut_at=1))
    env.reserve()
    env.ship(indices=(1, 2), commit=False)
    sender_events = env.run(PEER_TIMEOUT + 5)
    assert sender_events == [TransferFailed("x1", FailReason.PEER_DEAD, "silent for 10.0s")]
    assert [e.reason for e in env.events] == [FailReason.PEER_DEAD]
    env.send.send_block("x1", 3, 2, env.src, 3)          # a no-op after the failure
    env.send.commit("x1", 1, 14)
    assert env.written_exactly({6})


def test_delayed_block_after_commit_still_commits():
    """Commit before the last block waits for it; the transfer commits when it arrives."""
    env = Env(FaultPlan(delay={0: 2.5}))
    env.reserve()
    env.ship()
    assert env.recv.poll() == []
    env.run(3)
    assert [type(e) for e in env.events] == [TransferCommitted]
    assert env.written_exactly(SHIPPED)


def test_sender_abort_fails_and_late_frames_are_dropped():
    """An Abort from the sender fails the transfer; later frames are FINISHED_XFER drops."""
    env = Env()
    env.reserve()
    env.ship(indices=(1,), commit=False)
    env.send.abort("x1", "client cancelled")
    assert env.recv.poll() == [TransferFailed("x1", FailReason.PEER_ABORTED, "client cancelled")]
    env.raw(_frame(index=2, block_id=7), b"\x00" * 1024)
    env.raw(Commit("x1", 1, 14))
    assert env.recv.metrics.drops == Counter({DropReason.FINISHED_XFER: 2})
    assert env.written_exactly({6})


def test_receiver_abort_tells_sender_once():
    """abort() on D fails it once on D and once on P; P's later sends are no-ops."""
    env = Env()
    env.reserve()
    env.ship(indices=(1,), commit=False)
    env.recv.abort("x1", "preempted")
    assert env.recv.poll() == [TransferFailed("x1", FailReason.LOCAL_ABORT, "preempted")]
    assert env.send.poll() == [TransferFailed("x1", FailReason.PEER_ABORTED, "preempted")]
    env.ship(indices=(2, 3))
    env.recv.abort("x1")
    assert env.recv.poll() == [] and env.send.poll() == []
    assert env.recv.metrics.drops == Counter() and env.written_exactly({6})


def test_restarted_sender_fails_old_transfers():
    """A sender back with a new epoch is a new peer; its old epoch's transfers fail."""
    env = Env()
    env.reserve()
    env.ship(indices=(1,), commit=False)
    reborn = env.sender("p0")
    reborn.connect(env.recv.endpoint)
    assert [e.reason for e in env.recv.poll()] == [FailReason.PEER_RESTARTED]


def test_restarted_receiver_fails_senders_transfers_at_once():
    """A restarted receiver has no session for the sender: it answers the next heartbeat with a
    RESET (reading nothing), and P fails x1 once."""
    env = Env()
    env.reserve()
    env.recv.close()
    reborn = FakeReceiver(env.net, "d0", env.dst, make_identity(env.dst, "d0"), TEST_SECRET)
    events = env.send.poll() + env.run(1.0) + env.send.poll()
    assert events == [TransferFailed("x1", FailReason.PEER_RESTARTED, "receiver has no session for us")]
    assert reborn.metrics.drops == Counter({DropReason.NOT_AUTHENTICATED: 1})
    env.send.connect(reborn.endpoint)                    # pairs again with the new epoch


def test_fully_cached_prompt_commits_on_commit_alone():
    """With every block cached, only the Commit travels and the transfer commits."""
    env = Env()
    env.reserve(cached=4)
    env.send.commit("x1", 9, 14)
    assert env.recv.poll() == [TransferCommitted("x1", 9, 14, DST_IDS, 0, 0.0, 0.0)]
    assert env.written_exactly(set())


def test_commit_with_wrong_token_count_is_dropped():
    """num_tokens must fit the reserved block count, else BAD_COMMIT and no commit."""
    env = Env()
    env.reserve()
    env.ship(commit=False)
    env.raw(Commit("x1", 1, 17))              # 4 blocks of 4 tokens hold 13..16 tokens
    assert env.recv.metrics.drops == Counter({DropReason.BAD_COMMIT: 1})
    env.send.commit("x1", 1, 16)
    assert [type(e) for e in env.recv.poll()] == [TransferCommitted]


def test_register_refuses_overlap_and_reuse():
    """A block is reserved by at most one live transfer; xfer ids are never reused."""
    env = Env()
    env.reserve()
    with pytest.raises(ValueError):
        env.recv.register(Reservation("x2", (1, 2)))          # block 2 is x1's
    with pytest.raises(ValueError):
        env.recv.register(Reservation("x1", (0,)))
    with pytest.raises(ValueError):
        env.recv.register(Reservation("x3", (8,)))            # outside the 8-block pool
    env.recv.register(Reservation("x4", (5, 1), cached_prefix_blocks=1))  # 5 is x1's cached prefix


def test_a_peer_without_the_secret_cannot_pair_or_write():
    """A sender with another secret cannot pair (BAD_MAC, no reply); a frame cut short to
    [header, seal] (a split seal, which this receiver did not announce: UNEXPECTED), or from a connection that never completed the handshake, is dropped unread; a replayed sealed
    frame is dropped (REPLAY) and writes nothing."""
    env = Env(sender_secret=b"w" * 32, connect=False)
    with pytest.raises(TransportError):     # the fake link answers at once: the MAC is refused before any wait
        env.send.connect(env.recv.endpoint, timeout=0.2)
    assert env.recv.metrics.drops == Counter({DropReason.BAD_MAC: 1})
    env = Env()
    env.reserve()
    env.ship(indices=(1,), commit=False)
    block = bytes(block_bytes(env.src, 2))
    sealed = env.send.seal(env.recv.endpoint, _frame(index=2, block_id=7), block)
    env.send.send_raw(env.recv.endpoint, [sealed[0], sealed[1]])  # the payload cut off: a split seal, not announced
    stranger = env.sender("p9")
    stranger.send_raw(env.recv.endpoint, sealed)                               # someone else's frame
    env.send.send_raw(env.recv.endpoint, sealed)
    env.send.send_raw(env.recv.endpoint, sealed)                               # again: a replay
    assert env.recv.metrics.drops == Counter({DropReason.UNEXPECTED: 1, DropReason.NOT_AUTHENTICATED: 1,
                                              DropReason.REPLAY: 1})
    assert env.recv.ledger.state("x1") is TransferState.TRANSFERRING
    assert env.written_exactly({6, 7})


def test_an_unauthenticated_peer_learns_nothing():
    """A hello earns a random challenge and nothing else; a sealed-looking frame from a peer
    without a session earns a RESET; neither reveals the receiver's epoch, model or layout."""
    env = Env(connect=False)
    replies = []
    env.net.senders["spy"] = type("Spy", (), {"on_reply": lambda self, e, f: replies.append(f)})()
    env.recv.deliver("spy", [b"\x93\x01\xa5hello\x90", b"t" * 40])
    env.recv.deliver("spy", [auth_frame(AuthKind.HELLO, b"n" * 16)])
    assert [len(r) for r in replies] == [1, 1]
    assert replies[0] == [auth_frame(AuthKind.RESET)]
    assert replies[1][0][:5] == b"PDA1c" and len(replies[1][0]) == 21
    identity = env.recv._core.identity
    for secret_thing in (identity.epoch, identity.layout.model_id):
        assert all(secret_thing.encode() not in bytes(f) for r in replies for f in r)


def test_close_fails_live_transfers():
    """close() reports every live transfer as failed (CLOSED) so the node frees it."""
    env = Env()
    env.reserve()
    assert env.recv.close() == [TransferFailed("x1", FailReason.CLOSED, "receiver closed")]
