"""Pairing a step at a time (KVSender.try_connect): a node's loop never waits on a receiver's
replies, so a receiver that never answers holds nothing up but its own pairing, which fails at its
deadline; the sender's other receivers are served meanwhile."""
import contextlib
import socket
import time

import pytest

from kvtransport.base import TransportError
from kvtransport.events import TransferCommitted
from kvtransport.receiver_state import Reservation
from kvtransport.testing import TEST_SECRET, make_identity, make_pool, same_bytes
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _ends():
    """(src pool, dst pool, a ZmqSender p0 on src, a ZmqReceiver d0 on dst); both closed after."""
    src, dst = make_pool(seed=1), make_pool(seed=2)
    recv = ZmqReceiver(dst, make_identity(dst, "d0", "zmq"), TEST_SECRET)
    send = ZmqSender(make_identity(src, "p0", "zmq"), TEST_SECRET)
    try:
        yield src, dst, send, recv
    finally:
        send.close()
        recv.close()


def _pair_by_steps(send, recv, timeout=10.0):
    """try_connect and the receiver's poll in turn, on one thread (as two nodes' loops)."""
    deadline = time.monotonic() + timeout
    while (remote := send.try_connect(recv.endpoint)) is None:
        assert time.monotonic() < deadline, "pairing did not complete"
        recv.poll(0.01)
    return remote


def _ship_one(send, recv, src, after_poll=lambda: None) -> list:
    """Transfer x1: src's block 2 into the receiver's block 5, committed; the receiver's events,
    polled (after_poll() after each poll) until there are some."""
    recv.register(Reservation("x1", (5,), 0))
    send.begin("x1", recv.endpoint)
    send.send_block("x1", 0, 5, src, 2)
    send.commit("x1", 7, 3)
    events = []
    while not events:
        events += recv.poll(0.02)
        after_poll()
    return events


def test_try_connect_never_waits_and_pairs_over_steps():
    """The first step returns None at once (the receiver has not run yet); stepping both sides
    pairs them on one thread, after which try_connect and connect return the receiver's identity
    and a block ships bit-exactly."""
    with _ends() as (src, dst, send, recv):
        assert send.try_connect(recv.endpoint) is None
        assert _pair_by_steps(send, recv).node_id == "d0"
        assert send.try_connect(recv.endpoint).node_id == send.connect(recv.endpoint, 0.0).node_id == "d0"
        events = _ship_one(send, recv, src)
        assert isinstance(events[0], TransferCommitted) and same_bytes(dst[5], src[2])


def test_a_silent_receiver_fails_only_its_own_pairing_at_its_deadline():
    """A listener that never answers ZeroMQ's greeting: each try_connect returns None without
    waiting, the sender's poll keeps its half-open connection and serves a paired receiver's
    transfer meanwhile, and once the timeout passes the pairing raises TransportError and its
    connection is closed."""
    def still_pairing():
        assert send.poll(0.0) == [] and send.try_connect(dead) is None

    with _ends() as (src, dst, send, recv), socket.create_server(("127.0.0.1", 0)) as silent:
        dead = f"tcp://127.0.0.1:{silent.getsockname()[1]}"     # accepted by the kernel, never read
        _pair_by_steps(send, recv)
        assert send.try_connect(dead, timeout=3.0) is None
        assert isinstance(_ship_one(send, recv, src, still_pairing)[0], TransferCommitted)
        assert sorted(send._link.endpoints()) == sorted([recv.endpoint, dead])
        with pytest.raises(TransportError, match="did not answer the pairing in time"):
            while send.try_connect(dead) is None:
                time.sleep(0.01)
        assert send._link.endpoints() == [recv.endpoint]
        assert send.try_connect(dead, timeout=1.0) is None      # a new pairing starts afresh


def test_a_pairing_whose_channel_cannot_be_set_up_is_forgotten():
    """A payload channel whose set-up fails after the receiver's HelloAck (torch_dist: no P2PJoin,
    the TCPStore or the gloo join) fails the pairing: the sender is not connected and keeps no
    connection, its poll heartbeats nobody, and a new pairing pairs once the channel sets up."""
    def join_fails(*args):
        raise RuntimeError("gloo join timed out")

    with _ends() as (src, dst, send, recv):
        send._channel.paired = join_fails
        with pytest.raises(RuntimeError, match="gloo join timed out"):
            _pair_by_steps(send, recv)
        assert not send._core.is_connected(recv.endpoint) and send._link.endpoints() == []
        assert send.poll(1.5) == []         # past a heartbeat interval: none is due to the failed pairing
        del send._channel.paired
        assert _pair_by_steps(send, recv).node_id == "d0"
        assert isinstance(_ship_one(send, recv, src)[0], TransferCommitted) and same_bytes(dst[5], src[2])


def test_connect_joining_a_pairing_under_way_keeps_its_own_timeout():
    """connect(timeout=0.5) on a pairing try_connect started with a 60 s timeout, to a listener
    that never answers, raises TransportError once its own 0.5 s pass, and closes that pairing."""
    with _ends() as (src, dst, send, recv), socket.create_server(("127.0.0.1", 0)) as silent:
        dead = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        assert send.try_connect(dead, timeout=60.0) is None
        with pytest.raises(TransportError, match="did not answer the pairing in time"):
            send.connect(dead, timeout=0.5)
        assert send._link.endpoints() == [] and send.try_connect(dead, timeout=1.0) is None


@pytest.mark.parametrize("endpoint", ["tcp://no such host:5", "tcp://127.0.0.1", "bogus://x"])
def test_a_malformed_endpoint_fails_its_pairing_and_leaves_no_connection(endpoint):
    """An endpoint ZeroMQ cannot connect to raises TransportError (not zmq.ZMQError, which would
    end a prefill node) and leaves no connection; the sender pairs with a good receiver after."""
    with _ends() as (src, dst, send, recv):
        with pytest.raises(TransportError, match="cannot connect to"):
            send.try_connect(endpoint)
        assert send._link.endpoints() == [] and send.poll(0.0) == []
        assert _pair_by_steps(send, recv).node_id == "d0"
