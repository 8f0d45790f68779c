"""KV moves between two real decode node services over real ZMQ, the test acting as the router:
decode-0 pauses a running request and ships its blocks into decode-1's reservation, which decodes
on exactly where decode-0 stopped; what cannot move is refused and nothing leaks or stays pinned."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest
import zmq

from decode_node.mover import CONNECT_TIMEOUT_S, MAX_LOOP_STALL_S, SEND_TIMEOUT_S
from decode_node.service import DecodeService
from engine import SamplingParams
from kvtransport.base import TransportError
from kvtransport.metrics import DropReason
from node_shell.config import NodeConfig
from router.config import RouterConfig
from pdwire.control import (AbortRequest, DecodeRequest, NodeCommand, Paused, PauseRequest, PrefillRequest,
                            ShipRequest)
from pdwire.messages import Reserved
from tests.model_factory import hf_greedy
from tests.node_harness import HANG_S, NodeHarness, Result, secret_file, settled, tokens

PROMPT = [(i * 37) % 500 + 3 for i in range(21)]       # 2 full blocks of 8 and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


class MoveHarness(NodeHarness):
    """NodeHarness plus decode-1; the test routes moves itself: `ships` maps a moved attempt's rid
    to the paused rid whose blocks its reservation takes (and to whom the ShipRequest goes)."""

    def __init__(self, model_path: str, decode_tp: int = 1, **node_kwargs):
        super().__init__(model_path, decode_tp=decode_tp, **node_kwargs)
        cfg = dict(router=self.sock.getsockopt_string(zmq.LAST_ENDPOINT), model=model_path,
                   cluster_secret_file=secret_file(), **node_kwargs)
        self.decode1 = DecodeService(NodeConfig(node_id="decode-1", **cfg))
        self.cached["decode-1"], self.evicted["decode-1"] = set(), 0
        self.paused: dict[str, Paused] = {}
        self.ships: dict[str, tuple[str, str]] = {}     # moved rid -> (paused rid, its node)
        self.threads.append(threading.Thread(target=self._serve, args=(self.decode1,), daemon=True))
        self.threads[-1].start()
        self.pump(until=lambda: "decode-1" in self.hellos)

    def _on(self, node: str, msg) -> None:
        if isinstance(msg, Paused):
            self.paused[msg.rid] = msg
        elif isinstance(msg, Reserved) and msg.rid in self.ships:
            self.results[msg.rid].reserved = msg
            req = self.pending.pop(msg.rid)
            paused_rid, writer = self.ships[msg.rid]
            endpoint = self.hellos["decode-1"].kv_endpoint
            if writer == "prefill-0":       # not the writer decode-1 was told of
                self.send(writer, PrefillRequest(msg.rid, req.prompt_ids, req.params, endpoint, msg.xfer_id,
                                                 msg.dst_block_ids, msg.cached_prefix_blocks, req.prior_outputs))
            else:
                self.send(writer, ShipRequest(msg.rid, paused_rid, endpoint, msg.xfer_id, msg.dst_block_ids,
                                              msg.cached_prefix_blocks))
        else:
            super()._on(node, msg)

    def pause(self, rid: str, node: str = "decode-0") -> Paused:
        self.send(node, PauseRequest(rid))
        self.pump(lambda: rid in self.paused)
        return self.paused[rid]

    def reserve_moved(self, rid: str, paused: Paused, shipper: str = "decode-0") -> str:
        """decode-1 reserves the paused request's continuation, writer decode-0; `shipper` is sent
        the order to fill it (decode-0 a ShipRequest, prefill-0 a PrefillRequest); returns its rid."""
        moved, got = f"{rid}~1", tokens(self.results[rid])
        n = paused.num_tokens
        self.results[moved] = Result()
        params = dataclasses.replace(GREEDY, max_tokens=GREEDY.max_tokens - (n - 1))
        self.pending[moved] = DecodeRequest(moved, tuple(PROMPT + got[:n - 1]), params, "decode-0", n - 1)
        self.ships[moved] = (rid, shipper)
        self.send("decode-1", self.pending[moved])
        return moved

    def idle(self) -> None:
        super().idle()
        self.pump(lambda: settled(self.decode1), 30.0)

    def close(self) -> None:
        self.send("decode-1", NodeCommand("leave"))
        super().close()


@contextlib.contextmanager
def moving(model_path: str, decode_tp: int = 1):
    """A MoveHarness; at the end every node idle, every block accounted for, none pinned."""
    h = MoveHarness(model_path, decode_tp, block_size=8, num_blocks=48, lease_s=2.0)
    try:
        yield h
        h.idle()
    finally:
        h.close()
    for service in (h.prefill, h.decode, h.decode1):
        service.engine.check_integrity()
        assert not service.engine.block_manager.num_pins, f"{service.config.node_id} kept a block pinned"
        assert not service.engine.has_unfinished_requests()


@pytest.fixture
def harness(model_dir):
    with moving(model_dir[0]) as h:
        yield h


def _running(harness, rid: str, at_tokens: int = 6) -> None:
    harness.submit(rid, PROMPT, GREEDY)
    harness.pump(lambda: len(harness.results[rid].tokens) >= at_tokens)


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_a_paused_request_moves_with_its_blocks_and_decodes_on_exactly(model_dir, decode_tp):
    """decode-0 (tp 1, or 2: its ranks' heads gathered) pauses after n tokens (every one sent),
    holding the blocks of prompt + n - 1; its ShipRequest fills decode-1's reservation (full
    blocks and the partial last one, nothing prefilled), whose deltas start at the last token
    decode-0 sampled: together, transformers' greedy; decode-0 ends with nothing running and no pin."""
    path, hf = model_dir
    with moving(path, decode_tp) as harness:
        _move_and_finish(harness, hf)


def _move_and_finish(harness, hf) -> None:
    _running(harness, "r")
    paused = harness.pause("r")
    got = tokens(harness.results["r"])
    assert paused.num_tokens == len(got) >= 6
    assert harness.decode.mover.held["r"].num_tokens == len(PROMPT) + paused.num_tokens - 1
    written = harness.decode1.receiver.metrics.blocks_written
    harness.decode.mover.slice_blocks = 1        # a message a block: the ship goes in slices
    moved = harness.reserve_moved("r", paused)
    (m,) = harness.wait([moved])
    assert m.failed is None and m.finish == "length" and m.tokens[0] == got[-1]
    assert got[:-1] + tokens(m) == hf_greedy(hf, PROMPT, GREEDY.max_tokens)
    blocks = -(-(len(PROMPT) + paused.num_tokens - 1) // 8)
    assert harness.decode1.receiver.metrics.blocks_written - written == blocks - m.reserved.cached_prefix_blocks


def test_what_cannot_move_is_refused_and_a_hold_is_freed_once(harness):
    """A pause of an unknown request holds nothing (Paused 0); a ShipRequest naming no held
    request fails retryably; an AbortRequest frees a hold; a hold never shipped is freed when its
    lease (2 s here) runs out."""
    assert harness.pause("nobody") == Paused("nobody", 0, 0)
    harness.results["x~1"] = Result()
    harness.send("decode-0", ShipRequest("x~1", "x", "tcp://127.0.0.1:9", "a" * 32, (1,), 0))
    harness.pump(lambda: harness.results["x~1"].failed is not None)
    assert harness.results["x~1"].failed.retryable and "nothing held" in harness.results["x~1"].failed.reason
    for rid in ("aborted", "expired"):
        _running(harness, rid)
        assert harness.pause(rid).num_tokens > 0 and harness.decode.engine.block_manager.num_pins == 1
        if rid == "aborted":
            harness.send("decode-0", AbortRequest(rid))
        harness.pump(lambda: not harness.decode.mover.held)
        assert harness.decode.engine.block_manager.num_pins == 0


def test_only_the_named_writer_may_write_a_moved_reservation(harness):
    """decode-1's reservation names decode-0 as its writer: the prefill node, holding the cluster
    secret but not named, has every frame dropped (wrong peer) and the transfer fails at its lease;
    decode-0's hold is then released by the router's abort."""
    _running(harness, "r")
    paused = harness.pause("r")
    (m,) = harness.wait([harness.reserve_moved("r", paused, shipper="prefill-0")])
    assert m.failed is not None and m.failed.retryable and "transfer failed" in m.failed.reason
    assert harness.decode1.receiver.metrics.drops[DropReason.WRONG_PEER] > 0
    assert not harness.decode1.engine.has_unfinished_requests()
    harness.send("decode-0", AbortRequest("r"))


class _Stalled:
    """A sender whose receiving node stopped draining: pairing works, every send (the Abort too)
    times out with a TransportError, as a full queue's does after the send timeout."""

    now = 0.0       # seconds the sends held the loop, added to the mover's clock (none here)

    def blocks_per_message(self, endpoint: str, nbytes: int | None = None) -> None:
        return None     # packs nothing together: the mover's own slice applies

    def __init__(self):
        self.connects: list[float] = []     # the timeout of each pairing
        self.aborts: list[str] = []

    def connect(self, endpoint: str, timeout: float = 10.0):
        self.connects.append(timeout)

    def begin(self, xfer_id: str, endpoint: str) -> None:
        pass

    def takes_layers(self, xfer_id: str) -> bool:
        return False

    def send_blocks(self, *args) -> None:
        raise TransportError("not draining")

    def abort(self, xfer_id: str, reason: str = "") -> None:
        self.aborts.append(xfer_id)
        raise TransportError("not draining")

    def poll(self, timeout: float = 0.0) -> list:
        return []

    def waitables(self) -> list:
        return []

    def is_sent(self, xfer_id: str) -> bool:
        return True

    def close(self) -> None:
        pass


def _ship_to(harness, sender: "_Stalled"):
    """decode-0 pauses "r" and is told to ship it through `sender`, a block a send, its clock
    moved by the sender's sends; returns the move's RequestFailed."""
    mover = harness.decode.mover
    mover._make_sender, mover.slice_blocks = (lambda: sender), 1        # read on the node's thread
    mover.clock = lambda: time.monotonic() + sender.now
    _running(harness, "r")
    paused = harness.pause("r")
    blocks = -(-(len(PROMPT) + paused.num_tokens - 1) // 8)
    harness.results["r~1"] = Result()
    harness.send("decode-0", ShipRequest("r~1", "r", "tcp://127.0.0.1:9", "a" * 32, tuple(range(1, blocks + 1)), 0))
    harness.pump(lambda: harness.results["r~1"].failed is not None)
    return harness.results["r~1"].failed


def _serves_on(harness) -> None:
    """decode-0 has no pin left and a later request runs to its length."""
    harness.pump(lambda: harness.decode.engine.block_manager.num_pins == 0)
    (later,) = harness.wait([_submitted(harness, "later")])
    assert later.failed is None and later.finish == "length" and len(tokens(later)) == GREEDY.max_tokens


def test_a_move_into_a_node_that_stopped_draining_fails_the_move_not_the_node(harness):
    """The ship's sends and then its Abort time out (TransportError): the move fails retryably,
    its pins go, and decode-0 serves on (a later request runs to its length); the pairing had its
    bound."""
    stalled = _Stalled()
    failed = _ship_to(harness, stalled)
    assert failed.retryable and "KV move failed" in failed.reason and "not draining" in failed.reason
    assert (stalled.connects, stalled.aborts) == ([CONNECT_TIMEOUT_S], ["a" * 32])
    _serves_on(harness)


def _submitted(harness, rid: str) -> str:
    harness.submit(rid, PROMPT, GREEDY)
    return rid


class _Slow(_Stalled):
    """A sender whose receiving node drains slowly: every send succeeds, each after the longest a
    send may block (SEND_TIMEOUT_S), on a clock the test moves; the Abort times out."""

    def __init__(self):
        super().__init__()
        self.sent: list[list[int]] = []     # each send's block indices
        self.commits: list[str] = []
        self.aborted_at: float | None = None

    def send_blocks(self, xfer_id, indices, *args) -> None:
        self.now += SEND_TIMEOUT_S
        self.sent.append(list(indices))

    def commit(self, xfer_id: str, first_token: int, num_tokens: int) -> None:
        self.now += SEND_TIMEOUT_S
        self.commits.append(xfer_id)

    def abort(self, xfer_id: str, reason: str = "") -> None:
        self.now += SEND_TIMEOUT_S
        self.aborted_at = self.now
        super().abort(xfer_id, reason)


def test_a_ship_into_a_slowly_draining_node_fails_within_the_loop_bound(harness):
    """Each send succeeds only after SEND_TIMEOUT_S: the ship stops sending once the next send and
    an Abort could pass MAX_LOOP_STALL_S, aborts, and fails the move retryably (nothing committed);
    the loop was held at most MAX_LOOP_STALL_S in all, and decode-0 serves on."""
    slow = _Slow()
    failed = _ship_to(harness, slow)
    assert failed.retryable and "KV move failed" in failed.reason and f"past {MAX_LOOP_STALL_S:.0f} s" in failed.reason
    assert slow.sent == [[0], [1]] and slow.commits == [] and slow.aborts == ["a" * 32]
    assert slow.aborted_at <= MAX_LOOP_STALL_S < RouterConfig().heartbeat_timeout_s
    _serves_on(harness)


def test_a_runtime_error_in_the_gather_fails_only_that_move(harness):
    """The runner's export (at tp > 1 a gather across ranks) raises RuntimeError: that move fails
    retryably with the error, its transfer is aborted, its pins go, and decode-0 serves on."""
    slow, runner = _Slow(), harness.decode.engine.runner

    def broken(block_ids):
        raise RuntimeError("gather failed: rank 1 is gone")
    runner.export_blocks = broken
    try:
        failed = _ship_to(harness, slow)
    finally:
        del runner.export_blocks
    assert failed.retryable and "KV move failed" in failed.reason and "rank 1 is gone" in failed.reason
    assert slow.sent == [] and slow.aborts == ["a" * 32]
    _serves_on(harness)


class _SlowPeer(_Slow):
    """A slow but draining peer: each send takes SEND_TIMEOUT_S on the mover's clock and a
    heartbeat interval in real time (so the node's next heartbeat falls due during it); it logs
    its pairings and commits into `events`, beside the node's heartbeats."""

    def __init__(self, events: list[str], beat_s: float):
        super().__init__()
        self.events, self.beat_s = events, beat_s

    def connect(self, endpoint: str, timeout: float = 10.0):
        self.events.append("connect")

    def send_blocks(self, xfer_id, indices, *args) -> None:
        time.sleep(self.beat_s)
        super().send_blocks(xfer_id, indices, *args)

    def commit(self, xfer_id: str, first_token: int, num_tokens: int) -> None:
        super().commit(xfer_id, first_token, num_tokens)
        self.events.append("commit")


def test_two_ships_in_one_poll_have_a_heartbeat_between_them(harness):
    """Two ShipRequests arrive in one poll of decode-0's link (its loop held while both are
    queued): each ship may hold the loop up to MAX_LOOP_STALL_S, so a heartbeat goes out between
    the first ship's commit and the second's pairing, not only after both (which at k ships would
    be k x MAX_LOOP_STALL_S of silence, past the router's heartbeat timeout)."""
    node, events = harness.decode, []
    mover, link = node.mover, node.link
    peer = _SlowPeer(events, link.heartbeat_s)
    mover._make_sender, mover.slice_blocks = (lambda: peer), 64        # one send a ship
    mover.lease_s = HANG_S      # the holds outlast the test's waits on a loaded machine
    mover.clock = lambda: time.monotonic() + peer.now
    status, poll, ships_per_poll = link._status, link.poll, []
    link._status = lambda epoch: events.append("beat") or status(epoch)
    blocks = {}
    for rid in ("r", "s"):
        _running(harness, rid)
        blocks[rid] = -(-(len(PROMPT) + harness.pause(rid).num_tokens - 1) // 8)
    entered = threading.Event()

    def held(timeout: float, wake_on=()) -> list:
        """One poll that returns once both ShipRequests have come (a loop busy while they arrive)."""
        entered.set()
        deadline, got = time.monotonic() + HANG_S, []
        while sum(isinstance(m, ShipRequest) for m in got) < 2:
            assert time.monotonic() < deadline, "the ShipRequests did not come"
            got += poll(0.01)
        link.poll = lambda timeout, wake_on=(): _counted(poll(timeout, wake_on), ships_per_poll)
        return _counted(got, ships_per_poll)
    link.poll = held
    assert entered.wait(HANG_S)         # no poll before this one takes a ShipRequest
    for rid in ("r", "s"):
        harness.results[f"{rid}~1"] = Result()
        harness.send("decode-0", ShipRequest(f"{rid}~1", rid, "tcp://127.0.0.1:9", rid * 32,
                                             tuple(range(1, blocks[rid] + 1)), 0))
    harness.pump(lambda: len(peer.commits) == 2)
    assert ships_per_poll[0] == 2, "the two ShipRequests did not arrive in one poll"
    first_commit, second_connect = events.index("commit"), len(events) - 1 - events[::-1].index("connect")
    assert events.count("connect") == 2 and first_commit < second_connect
    assert "beat" in events[first_commit:second_connect], events
    assert harness.results["r~1"].failed is None and harness.results["s~1"].failed is None


def _counted(messages: list, counts: list[int]) -> list:
    """messages, with the number of ShipRequests among them appended to counts."""
    counts.append(sum(isinstance(m, ShipRequest) for m in messages))
    return messages
