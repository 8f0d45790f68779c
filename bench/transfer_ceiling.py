"""The raw-ZeroMQ ceiling of KV shipping, in transfer_bench.py's process layout.

A spawned process owns a preallocated pool and a ROUTER socket; this process sends `n` blocks
from its own pool through a DEALER, each zero-copy (copy=False, no tracker), and the receiver
receives each straight into its pool slot with recv_into (one memcpy, from libzmq's buffer, as a
decode node must; pdserve's receiver does the same since the tenth session, and recv_into is the
cheaper raw pattern: bench/transfer_recv_patterns.py). No headers, no checks, no bookkeeping:
what pdserve's transfer path is measured against. With `mac=True` each block also carries a
small header sealed and opened by kvtransport.session.Session, one MAC per block, as an
authenticated transport must at least do: [header, seal, block], the seal's MAC checked before
the block is received into its slot (pdserve's order since the eleventh session). With
`stream=True` each block is received zero-copy and copied into its slot with streaming stores
(kvtransport/stream_copy.py, as pdserve's receiver copies since the thirtieth session; recv_into's copy
is libzmq's memcpy): the ceiling of that copy. Its process
tells glibc to keep freed frames exactly as a ZmqReceiver does (kvtransport.heap), unless the
bench runs both with glibc's defaults (retain_heap=False).
"""
from __future__ import annotations

import multiprocessing as mp
import resource
import time

import torch
import zmq

from kernels import huge_pages
from kvtransport.heap import retain_freed
from kvtransport.session import Session
from kvtransport.stream_copy import copy_into

HWM = 16
_NONCES = (b"i" * 16, b"r" * 16)


def ceiling_process(conn, nbytes: int, num_blocks: int, bind: str, secret: bytes, retain_heap: bool) -> None:
    """Receives `n` blocks per command into a pool of num_blocks blocks; reports its CPU seconds."""
    torch.set_num_threads(1)
    if retain_heap:
        retain_freed((HWM + 1) * nbytes)        # as ZmqReceiver: the queue and the message being read
    pool = memoryview(huge_pages.empty(num_blocks * nbytes, torch.uint8).zero_().numpy())   # as the engine's pool
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while (cmd := conn.recv()) is not None:
        n, mac, stream = cmd
        session = Session(secret, *_NONCES, initiator=False) if mac else None
        conn.send("ready")
        cpu, faults, main = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
        switches = thread_switches()
        for k in range(n):
            if not sock.poll(30_000):
                conn.send(("failed", f"block {k} of {n} did not arrive"))
                break
            sock.recv()                                     # routing id
            if session is not None and session.open_seal(sock.recv(), sock.recv()) != [nbytes]:
                raise RuntimeError("a seal that does not declare one block")
            slot = k % num_blocks
            if stream:
                copy_into(pool[slot * nbytes:(slot + 1) * nbytes], sock.recv(copy=False))
            else:
                sock.recv_into(pool[slot * nbytes:(slot + 1) * nbytes])
        else:
            conn.send(("done", time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                       time.thread_time() - main, thread_switches() - switches))
    sock.close()
    ctx.term()


def thread_switches() -> int:
    """Context switches of the calling thread so far, voluntary (it waited) and involuntary (preempted)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_nvcsw + usage.ru_nivcsw


class Ceiling:
    """The sending end; start() spawns the receiver, run() times one transfer of n blocks."""

    def __init__(self, src: torch.Tensor, bind: str, secret: bytes, retain_heap: bool = True) -> None:
        self._blocks = [memoryview(src[b].view(torch.uint8).view(-1).numpy()) for b in range(src.shape[0])]
        self._nbytes, self._bind, self._secret = len(self._blocks[0]), bind, secret
        self._retain_heap = retain_heap
        self._ctx = zmq.Context(io_threads=1)

    def start(self) -> None:
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(
            target=ceiling_process, args=(child, self._nbytes, len(self._blocks), self._bind, self._secret, self._retain_heap))
        self._proc.start()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self._conn.recv())

    def run(self, mac: bool, stream: bool = False, timeout: float = 120.0) -> tuple[float, float, float, int, float, int]:
        """(wall seconds, sender CPU seconds, receiver CPU seconds, receiver minor page faults, CPU
        seconds of the receiver's Python thread, its context switches) of one transfer of every block
        (stream: copied into the pool with streaming stores)."""
        n = len(self._blocks)
        session = Session(self._secret, *_NONCES, initiator=True) if mac else None
        self._conn.send((n, mac, stream))
        if not self._conn.poll(timeout) or self._conn.recv() != "ready":     # as pdserve waits for its reservation
            raise RuntimeError("ceiling receiver silent")
        cpu, start = time.process_time(), time.perf_counter()
        for k, block in enumerate(self._blocks):
            if session is None:
                self._sock.send(block, copy=False)
            else:
                header = k.to_bytes(8, "little") * 12      # ~ a block header's size
                self._sock.send_multipart([header, session.seal_first(header, [len(block)]), block], copy=False)
        if not self._conn.poll(timeout):
            raise RuntimeError("ceiling receiver silent")
        reply = self._conn.recv()
        if reply[0] == "failed":
            raise RuntimeError(f"ceiling transfer failed: {reply[1]}")
        return time.perf_counter() - start, time.process_time() - cpu, reply[1], reply[2], reply[3], reply[4]

    def stop(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=10)
        self._sock.close()
        self._ctx.term()
