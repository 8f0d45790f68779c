"""The receive side's flow, one for every backend: a ReceiverCore over a link and a payload sink.

The link hands each message to the core (handshake, dispatch, replies over the link); the sink
moves payloads into the pool. Backends differ only in the strategies they are built from
(kvtransport.factory): ZmqReceiver (zmq link, InlineSink or BlockWriterSink), DistReceiver
(zmq link, torch.distributed sink), FakeReceiver (fake link, InlineSink).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from kvtransport.base import KVReceiver
from kvtransport.events import TransferEvent
from kvtransport.link import ReceiveLink
from kvtransport.metrics import DropReason
from kvtransport.receiver_core import PayloadSink, ReceiverCore
from kvtransport.receiver_state import ReceiveLedger, Reservation
from pdwire.handshake import PeerIdentity
from pdwire.messages import BATCH_BYTES

if TYPE_CHECKING:
    import zmq


class Receiver(KVReceiver):
    """Receives blocks from any number of senders into a pool of num_blocks blocks, through sink."""

    def __init__(self, num_blocks: int, identity: PeerIdentity, secret: bytes, link: ReceiveLink,
                 sink: PayloadSink, peer_timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_batch_bytes: int = BATCH_BYTES,
                 split_payloads: bool = False) -> None:
        """split_payloads: let senders send a batch's payloads as messages of their own (only
        over a link that lands them)."""
        self._link = link
        self._core = ReceiverCore(num_blocks, identity, secret, sink, link.send, peer_timeout, clock,
                                  max_batch_bytes, split_payloads and link.lands)
        link.bind(self._core.handle, self._core)
        self.endpoint = link.endpoint
        self.metrics = self._core.metrics

    @property
    def ledger(self) -> ReceiveLedger:
        return self._core.ledger

    def register(self, reservation: Reservation) -> None:
        self._core.register(reservation)

    def waitables(self) -> list[zmq.Socket]:
        return self._link.waitables()

    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        """Handle messages until an event is ready or timeout passes; then check liveness."""
        deadline = time.monotonic() + timeout
        events: list[TransferEvent] = []
        while True:
            self._link.receive(max(0.0, deadline - time.monotonic()))
            for address in self._link.take_refused():
                self.metrics.count_drop(DropReason.ZMTP_REFUSED, address, "ZMTP handshake refused")
            self._core.tick()
            events += self._core.take_events()
            if events or time.monotonic() >= deadline:
                return events

    def abort(self, xfer_id: str, reason: str = "") -> None:
        self._core.abort(xfer_id, reason)

    def close(self) -> list[TransferEvent]:
        self._core.close()
        self._link.close()
        return self._core.take_events()
