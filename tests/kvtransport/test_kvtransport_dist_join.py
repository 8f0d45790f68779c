"""torch.distributed backend, the decode side's group join: it runs off the node's loop, so a
prefill node that is slow to join its pair's group holds up nobody else.

Both prefill nodes and the decode node run in this process (gloo pairs threads as well as
processes); the decode node's loop is the test's thread."""
import threading
import time

import pytest

from kvtransport import torch_dist
from kvtransport.events import TransferCommitted
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.torch_dist import DistReceiver, DistSender

pytestmark = pytest.mark.timeout(300)

GEOM = dict(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
HANG_S = 120.0      # only bounds a hang: the decode node's join waits this long for a peer


def _until(cond, step, what: str, timeout: float = HANG_S) -> None:
    """Run step() until cond() holds; fail if it has not within timeout s (a hang)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen"
        step()


def _ship(send, recv, xfer_id: str, src, dst_ids) -> list:
    """xfer_id: src's blocks 1.. into dst_ids, committed; the receiver's events until one comes."""
    send.begin(xfer_id, recv.endpoint)
    for i, dst in enumerate(dst_ids):
        send.send_block(xfer_id, i, dst, src, i + 1)
    send.commit(xfer_id, 7, len(dst_ids) * GEOM["block_size"])
    events = []
    _until(lambda: events, lambda: events.extend(recv.poll(0.01)) or send.poll(0.0), f"{xfer_id}'s commit")
    return events


def test_a_hanging_group_join_does_not_stall_the_decode_loop(monkeypatch):
    """While one prefill node holds its pairing after taking the P2PJoin (its group join not
    begun), the decode node's loop pairs another prefill node, whose node id is as long as an id
    may be, and lands its blocks; the slow one then joins and its blocks land too."""
    monkeypatch.setattr(torch_dist, "MAX_JOIN_S", HANG_S)     # a starved machine joins slowly
    dst = make_pool(seed=None, **GEOM)
    recv = DistReceiver(dst, make_identity(dst, "d0", "torch_dist"), TEST_SECRET, peer_timeout=HANG_S)
    srcs = {name: make_pool(seed=seed, **GEOM) for name, seed in (("slow", 1), ("fast", 2))}
    slow = DistSender(make_identity(srcs["slow"], "p-slow", "torch_dist"), TEST_SECRET, peer_timeout=HANG_S)
    fast = DistSender(make_identity(srcs["fast"], "p" * 64, "torch_dist"), TEST_SECRET, peer_timeout=HANG_S)
    took_join, release, slow_paired = threading.Event(), threading.Event(), []
    join_group = slow._channel.paired

    def held_join(endpoint, remote, join, timeout):
        took_join.set()
        assert release.wait(HANG_S)
        join_group(endpoint, remote, join, HANG_S)

    slow._channel.paired = held_join
    slow_thread = threading.Thread(target=lambda: slow_paired.append(slow.connect(recv.endpoint, 2 * HANG_S)))
    recv.register(Reservation("xs", (1, 2)))
    recv.register(Reservation("xf", (4, 5)))
    try:
        slow_thread.start()
        _until(took_join.is_set, lambda: recv.poll(0.01), "the slow node's P2PJoin")
        _until(lambda: fast.try_connect(recv.endpoint, HANG_S) is not None, lambda: recv.poll(0.01),
               "the fast node's pairing")
        (done,) = _ship(fast, recv, "xf", srcs["fast"], (4, 5))
        assert isinstance(done, TransferCommitted) and not slow_paired
        release.set()
        _until(lambda: slow_paired, lambda: recv.poll(0.01), "the slow node's pairing")
        (done,) = _ship(slow, recv, "xs", srcs["slow"], (1, 2))
        assert isinstance(done, TransferCommitted)
        for name, dst_ids in (("fast", (4, 5)), ("slow", (1, 2))):
            for i, b in enumerate(dst_ids):
                assert same_bytes(dst[b], srcs[name][i + 1]), (name, b)
    finally:
        release.set()
        slow_thread.join(2 * HANG_S)
        for end in (slow, fast, recv):
            end.close()
