"""torch.distributed backend (gloo on CPU): blocks move bit-exactly between two processes.

The test process is the decode node; it spawns this file as the prefill node process.
"""
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from kvtransport.base import TransportError
from kvtransport.events import TransferCommitted
from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from kvtransport.testing import make_identity, make_pool, same_bytes, TEST_SECRET
from kvtransport.torch_dist import MAX_JOIN_S, DistReceiver, DistSender
from pdwire.messages import P2PJoin
from router.config import RouterConfig

GEOM = dict(num_blocks=12, num_layers=2, block_size=16, num_kv_heads=2, head_dim=32)
DST_IDS = (9, 3, 11, 0)            # block 9 is a cached prefix: not shipped
SRC_IDS = (1, 2, 3, 4)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _prefill_main(endpoints: dict[str, str]) -> None:
    """The prefill process: one DistSender per decode pool; a stray block first, then x1."""
    for dtype, endpoint in endpoints.items():
        src = make_pool(dtype=DTYPES[dtype], seed=1, **GEOM)
        send = DistSender(make_identity(src, "p0", "torch_dist"), TEST_SECRET, peer_timeout=20.0)
        send.connect(endpoint, timeout=20.0)
        send.begin("x1", endpoint)
        send.send_block("x1", 1, 5, src, 7)               # block 5 is not reserved: drained
        for i in range(1, 4):
            send.send_block("x1", i, DST_IDS[i], src, SRC_IDS[i])
        send.commit("x1", 123, 3 * 16 + 5)
        deadline = time.monotonic() + 20
        while not send.is_sent("x1") and time.monotonic() < deadline:
            send.poll(0.01)
        assert send.is_sent("x1")
        send.close()


@pytest.mark.timeout(90)
def test_gloo_pair_moves_blocks_bit_exactly():
    """Two processes, gloo on CPU: fp32 and bf16 blocks land bit-exactly; a stray block is drained."""
    pools, recvs = {}, {}
    for name, dtype in DTYPES.items():
        pools[name] = make_pool(dtype=dtype, seed=2, **GEOM)
        recvs[name] = DistReceiver(pools[name], make_identity(pools[name], f"d-{name}", "torch_dist"),
                                   TEST_SECRET, peer_timeout=20.0)
        recvs[name].register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
    before = {n: p.clone() for n, p in pools.items()}
    endpoints = {n: r.endpoint for n, r in recvs.items()}
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, __file__, json.dumps(endpoints)], cwd=root, env=env)
    try:
        events = {n: [] for n in recvs}
        deadline = time.monotonic() + 60
        while any(not e for e in events.values()) and time.monotonic() < deadline:
            for name, recv in recvs.items():
                events[name] += recv.poll(0.02)
        assert proc.wait(timeout=30) == 0
        for name, recv in recvs.items():
            (ev,) = events[name]
            assert isinstance(ev, TransferCommitted) and (ev.first_token, ev.num_tokens) == (123, 53)
            src = make_pool(dtype=DTYPES[name], seed=1, **GEOM)
            shipped = dict(zip(DST_IDS[1:], SRC_IDS[1:]))
            for b in range(GEOM["num_blocks"]):
                want = src[shipped[b]] if b in shipped else before[name][b]
                assert same_bytes(pools[name][b], want), (name, b)
            assert recv.metrics.drops == Counter({DropReason.NOT_RESERVED: 1})
    finally:
        proc.kill()
        for recv in recvs.values():
            recv.close()


def test_dist_requires_torch_dist_identity():
    """A DistSender refuses an identity that advertises another transport."""
    src = make_pool(**GEOM)
    with pytest.raises(ValueError):
        DistSender(make_identity(src, "p0", "zmq"), TEST_SECRET)


def test_a_withheld_p2pjoin_is_waited_for_a_step_at_a_time():
    """A decode node that accepts the Hello but sends no P2PJoin (frozen after its HelloAck): the
    sender waits for the P2PJoin over steps that return at once, as for the earlier replies, and the
    pairing fails at its deadline, forgotten (not connected, no connection left)."""
    dst, src = make_pool(seed=2, **GEOM), make_pool(seed=1, **GEOM)
    recv = DistReceiver(dst, make_identity(dst, "d0", "torch_dist"), TEST_SECRET)
    send = DistSender(make_identity(src, "p0", "torch_dist"), TEST_SECRET)
    recv._core._sink.paired = lambda *args: None       # no P2PJoin, no group
    steps_awaiting_join = 0
    try:
        with pytest.raises(TransportError, match="did not answer the pairing in time"):
            while send.try_connect(recv.endpoint, timeout=2.0) is None:
                steps_awaiting_join += send._core.is_connected(recv.endpoint)    # HelloAck taken
                recv.poll(0.01)
        assert steps_awaiting_join > 1
        assert not send._core.is_connected(recv.endpoint) and send._link.endpoints() == []
    finally:
        send.close()
        recv.close()


def test_a_p2pjoin_after_the_link_was_lost_fails_the_pairing():
    """A P2PJoin that comes after the sender's poll lost the half-paired link (silent past
    peer_timeout) fails the pairing with TransportError, a node's usual error, not KeyError."""
    dst, src = make_pool(seed=2, **GEOM), make_pool(seed=1, **GEOM)
    recv = DistReceiver(dst, make_identity(dst, "d0", "torch_dist"), TEST_SECRET)
    send = DistSender(make_identity(src, "p0", "torch_dist"), TEST_SECRET, peer_timeout=0.2)
    replies = []
    recv._core._sink.paired = lambda peer, identity, reply: replies.append(reply)     # P2PJoin later
    try:
        while not send._core.is_connected(recv.endpoint):      # the HelloAck taken
            assert send.try_connect(recv.endpoint, timeout=10.0) is None
            recv.poll(0.01)
        send.poll(0.5)                          # no reply to its heartbeats: lost
        assert not send._core.is_connected(recv.endpoint)
        replies[0](P2PJoin("p0/e", "127.0.0.1", 1))
        with pytest.raises(TransportError, match="was lost"):
            while send.try_connect(recv.endpoint) is None:
                recv.poll(0.01)
        assert send._link.endpoints() == []
    finally:
        send.close()
        recv.close()


def test_the_join_leaves_room_under_the_routers_heartbeat_timeout():
    """The group join's hold of a prefill node's loop (about 2 * MAX_JOIN_S: the TCPStore's connect
    overruns its timeout by a retry delay) plus 3 s for an engine step fits the router's default
    heartbeat timeout."""
    assert 2 * MAX_JOIN_S + 3.0 <= RouterConfig().heartbeat_timeout_s


if __name__ == "__main__":
    _prefill_main(json.loads(sys.argv[1]))
