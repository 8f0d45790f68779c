"""ZMQ receive side: one ROUTER socket, any number of prefill peers, over TCP or IPC.

Each peer is told apart by its routing id, and proves it holds the cluster secret before any of
its messages is read (kvtransport.session). Frames arrive as [routing id, header, payload?, mac?]
and are received with copy=False, so a block's payload is copied once, from the socket buffer
straight into its reserved pool block. The socket binds to 127.0.0.1 unless an address is given.
libzmq disconnects a peer that sends a frame above `max_frame_bytes`; the receive high-water
mark bounds what one peer can queue.
"""
from __future__ import annotations

import logging
import time

import torch
import zmq

from kvtransport.base import KVReceiver
from kvtransport.events import TransferEvent
from kvtransport.framing import Buffer
from pdwire.handshake import PeerIdentity
from pdwire.messages import MAX_HEADER_BYTES
from kvtransport.payload import InlineSink
from kvtransport.receiver_core import PayloadSink, ReceiverCore
from kvtransport.receiver_state import Reservation

log = logging.getLogger("kvtransport")

DEFAULT_BIND = "tcp://127.0.0.1:*"
_DRAIN_BATCH = 256      # messages handled per wake-up before leases and peers are checked


class ZmqReceiver(KVReceiver):
    """Receives blocks from any number of ZmqSenders into `kv_cache`: straight in when its blocks
    are wire blocks (every kv head), else through `sink` (e.g. a BlockWriterSink)."""

    def __init__(self, kv_cache: torch.Tensor, identity: PeerIdentity, secret: bytes,
                 bind: str = DEFAULT_BIND, peer_timeout: float = 10.0, hwm: int = 64,
                 sink: PayloadSink | None = None) -> None:
        sink = sink or InlineSink(kv_cache, identity.layout)     # before the socket: may raise
        block_nbytes = identity.layout.block_nbytes
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(block_nbytes, MAX_HEADER_BYTES) + 64)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._core = ReceiverCore(kv_cache.shape[0], identity, secret, sink, self._send, peer_timeout)
        self.metrics = self._core.metrics

    @property
    def ledger(self):
        return self._core.ledger

    def register(self, reservation: Reservation) -> None:
        self._core.register(reservation)

    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        """Handle messages until an event is ready or timeout passes; then check liveness."""
        deadline = time.monotonic() + timeout
        events: list[TransferEvent] = []
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if self._sock.poll(int(remaining * 1000), zmq.POLLIN):
                self._drain()
            self._core.tick()
            events += self._core.take_events()
            if events or time.monotonic() >= deadline:
                return events

    def abort(self, xfer_id: str, reason: str = "") -> None:
        self._core.abort(xfer_id, reason)

    def close(self) -> list[TransferEvent]:
        self._core.close()
        self._sock.close(linger=0)
        self._ctx.term()
        return self._core.take_events()

    def _drain(self) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes.hex()
            self._core.handle(peer, [f.buffer for f in frames[1:]])

    def _send(self, peer: str, frames: list[Buffer]) -> None:
        try:
            self._sock.send_multipart([bytes.fromhex(peer), *frames], zmq.NOBLOCK)
        except zmq.ZMQError as e:   # peer gone (EHOSTUNREACH) or not draining (EAGAIN)
            log.info("reply to %s not sent: %s", peer, e)
