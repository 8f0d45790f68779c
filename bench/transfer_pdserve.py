"""pdserve's side of bench/transfer_bench.py: a ZmqSender in the bench's process, a ZmqReceiver
in a spawned decode process (bench/transfer_ceiling.py is the raw-ZeroMQ side, in the same layout).

The decode process registers a reservation of every pool block per command, reports each
committed transfer with its CPU seconds (the process's, and its Python thread's alone), minor
page faults and context switches since the reservation, and polls its command pipe only between
transfers (commands come only then; the ceiling's process polls nothing but its socket).
"""
from __future__ import annotations

import multiprocessing as mp
import resource
import time
from typing import NamedTuple

import torch

from bench.transfer_ceiling import thread_switches
from kvtransport.events import TransferCommitted
from kvtransport.receiver_state import Reservation
from kvtransport.testing import make_identity, make_pool
from kvtransport.zmq_receiver import ZmqReceiver
from kvtransport.zmq_sender import ZmqSender


class Run(NamedTuple):
    wall: float         # seconds from the first send to the receiver's report
    send_cpu: float     # CPU seconds of the sending process (all threads) meanwhile
    recv_cpu: float     # CPU seconds of the receiving process, from its reservation to the commit
    recv_faults: int    # minor page faults of the receiving process meanwhile (libzmq's fresh buffers)
    recv_main_cpu: float   # CPU seconds of its Python thread alone (the rest: libzmq's I/O thread)
    recv_main_switches: int   # context switches of that thread, voluntary and not (each one leaves its caches cold)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


LAYOUT = dict(num_layers=8, num_kv_heads=8, head_dim=64, dtype=torch.float32)
PEER_TIMEOUT = 120.0     # this bench sends no heartbeats between runs; a loaded machine stalls for seconds


def decode_process(conn, block_size: int, num_blocks: int, bind: str, secret, batch_bytes: int,
                   queue_bytes: int, retain_heap: bool, split: bool) -> None:
    """Owns a pool and a ZmqReceiver: registers what it is told, reports committed transfers."""
    torch.set_num_threads(1)
    pool = make_pool(num_blocks=num_blocks, block_size=block_size, seed=None, **LAYOUT)
    recv = ZmqReceiver(pool, make_identity(pool, "bench-d", "zmq"), secret, bind, hwm=16, peer_timeout=PEER_TIMEOUT,
                       max_batch_bytes=batch_bytes, max_queue_bytes=queue_bytes, retain_heap=retain_heap,
                       split_payloads=split)
    conn.send(recv.endpoint)
    cpu, pending = 0.0, False
    while True:
        while not pending and conn.poll():      # commands come only between transfers: during one,
            cmd = conn.recv()                   # the pipe is not polled (the ceiling's process does not)
            if cmd is None:
                recv.close()
                return
            recv.register(Reservation(cmd, tuple(range(num_blocks)), lease_s=PEER_TIMEOUT))
            conn.send("registered")
            cpu, faults, main, switches = time.process_time(), minor_faults(), time.thread_time(), thread_switches()
            pending = True
        for ev in recv.poll(1.0 if pending else 0.01):
            ok, pending = isinstance(ev, TransferCommitted), False
            conn.send((ev.xfer_id, time.process_time() - cpu, minor_faults() - faults, time.thread_time() - main,
                       thread_switches() - switches) if ok else ("failed", ev))


class Pdserve:
    """pdserve's path: a ZmqSender here, a ZmqReceiver in a spawned decode process."""

    def __init__(self, block_size: int, tokens: int, bind: str, secret: bytes, batch_bytes: int,
                 queue_bytes: int, retain_heap: bool, split: bool) -> None:
        self.num_blocks = -(-tokens // block_size)
        self.src = make_pool(num_blocks=self.num_blocks, block_size=block_size, seed=0, **LAYOUT)
        self._args = (block_size, self.num_blocks, bind, secret, batch_bytes, queue_bytes, retain_heap, split)
        self._tokens, self._runs = tokens, 0

    def start(self) -> None:
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=decode_process, args=(child, *self._args))
        self._proc.start()
        self._endpoint = self._conn.recv()
        self.send = ZmqSender(make_identity(self.src, "bench-p", "zmq"), self._args[3], hwm=16,
                              peer_timeout=PEER_TIMEOUT, max_batch_bytes=self._args[4])
        self.send.connect(self._endpoint)

    def run(self, chunk_blocks: int) -> Run:
        """One transfer: blocks handed to send_blocks chunk_blocks at a time (as a prefill step
        hands them), or one send_block call each (chunk_blocks 0, no batching)."""
        xfer_id, n = f"x{self._runs}", self.num_blocks
        self._runs += 1
        self._conn.send(xfer_id)
        _reply(self._conn, self._proc)                  # the reservation is in place
        self.send.begin(xfer_id, self._endpoint)
        cpu, start = time.process_time(), time.perf_counter()
        if chunk_blocks:
            for k in range(0, n, chunk_blocks):
                ids = list(range(k, min(n, k + chunk_blocks)))
                self.send.send_blocks(xfer_id, ids, ids, self.src, ids)
        else:
            for b in range(n):
                self.send.send_block(xfer_id, b, b, self.src, b)
        self.send.commit(xfer_id, 1, self._tokens)
        _, recv_cpu, recv_faults, recv_main, recv_switches = _reply(self._conn, self._proc)
        return Run(time.perf_counter() - start, time.process_time() - cpu, recv_cpu, recv_faults, recv_main,
                   recv_switches)

    def stop(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=10)
        self.send.close()


def _reply(conn, proc, timeout: float = 120.0):
    """The decode process's report of one transfer; raises if it failed or the process died."""
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"decode process gone or silent (exit code {proc.exitcode})")
    reply = conn.recv()
    if reply[0] == "failed":
        raise RuntimeError(f"transfer failed: {reply[1]}")
    return reply
