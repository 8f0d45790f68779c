"""A peer that owes a split batch payloads (kvtransport/zmq_link.py): the receive link's wait for
them stays within --kv-poll-ms whatever interrupts it, and a message that is not the owed payload
writes no byte of the slot it was owed to."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from kvtransport.metrics import DropReason
from kvtransport.receiver_state import Reservation
from kvtransport.testing import same_bytes
from pdwire.messages import Heartbeat
from tests.kvtransport.test_kvtransport_split import _split_header
from tests.kvtransport.test_kvtransport_zmq import DST_IDS, SRC_IDS, _connect, _pair, _until


def _owing(send, recv, src):
    """recv owes a split batch of blocks 1 and 2 from send; the batch's header."""
    ep = recv.endpoint
    _connect(send, recv)
    recv.register(Reservation("x1", DST_IDS, cached_prefix_blocks=1))
    send.begin("x1", ep)
    header = send._core.batch_header("x1", [1, 2], [DST_IDS[1], DST_IDS[2]], src)
    send._link.send(ep, _split_header(send, ep, header, [header.nbytes] * 2))
    _until(recv, lambda: recv._core._owed != {})
    return header


def test_signals_do_not_stretch_the_wait_for_owed_payloads():
    """A signal with a Python handler every 5 ms for 3 s, aimed at the receiving thread: a blocking
    receive restarted after each (pyzmq retries EINTR with the whole RCVTIMEO) held the call for
    as long as the signals came. The wait is a poll now, which pyzmq counts down, if only in whole
    seconds (pyzmq 27's zmq_poll keeps its start and end times as C ints): at most ~1 s more."""
    src, dst, recv, send = _pair("tcp", max_poll_s=0.050)
    old = signal.signal(signal.SIGUSR1, lambda *a: None)
    stop = threading.Event()
    main = threading.get_ident()

    def interrupt():
        end = time.monotonic() + 3.0
        while not stop.is_set() and time.monotonic() < end:
            signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.005)
    try:
        _owing(send, recv, src)
        first, _ = send._channel.inline_many(src, [SRC_IDS[1], SRC_IDS[2]])
        send._link.send(recv.endpoint, [first])
        assert recv._link._sock.poll(10_000)       # the payload is queued, not taken yet
        pinger = threading.Thread(target=interrupt)
        pinger.start()
        start = time.monotonic()
        recv._link.receive(60.0)
        took = time.monotonic() - start
        stop.set()
        pinger.join()
        assert took < 2.0, f"receive() held its caller {took:.2f} s with --kv-poll-ms 50"
    finally:
        stop.set()
        signal.signal(signal.SIGUSR1, old)
        send.close()
        recv.close()


@pytest.mark.parametrize("kind", ["short", "long", "non-bare"])
def test_no_byte_of_a_wrong_message_lands_in_an_owed_slot(kind):
    """A bare payload one byte short or 64 bytes long, or a message of several frames (a
    Heartbeat) where a payload was owed: the batch is dropped (BAD_NBYTES) and slot 1 keeps every
    byte (recv_into wrote such a frame, cut to the slot); a right-sized payload after it lands."""
    src, dst, recv, send = _pair("tcp")
    ep = recv.endpoint
    try:
        n = _owing(send, recv, src).nbytes
        before = dst.clone()
        payload = bytes(torch.full((n,), 0xEE, dtype=torch.uint8).numpy())
        messages = {"short": [[payload[:-1]], [payload]], "long": [[payload + bytes(64)], [payload]],
                    "non-bare": [send._core.pack(ep, Heartbeat(send._core.identity.epoch, ("x1",)))]}[kind]
        for message in messages:
            send._link.send(ep, message)
        _until(recv, lambda: recv.metrics.drops.get(DropReason.BAD_NBYTES, 0) == 1)
        assert recv._core._owed == {}
        if kind != "non-bare":      # the right-sized payload after it lands in slot 2, its own
            before[DST_IDS[2]] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dst.dtype).view(dst.shape[1:])
        assert same_bytes(dst[DST_IDS[1]], before[DST_IDS[1]]), "bytes landed in slot 1"
        assert same_bytes(dst, before)
    finally:
        send.close()
        recv.close()
