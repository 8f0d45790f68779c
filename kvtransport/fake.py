"""In-process backend: instant delivery through the real codec, with failure injection.

Frames go through the same sessions, Framer, ReceiverCore and ReceiveLedger as on a socket;
only the socket is replaced by a direct call. A FaultPlan acts on the messages a FakeSender sends after
its handshake, numbered 0, 1, 2, ... (blocks, commits, aborts and heartbeats alike):

  drop        never delivered            duplicate   delivered twice
  corrupt     header cut to half (BAD_MAC)        delay       delivered by the first poll() at or
  cut_at=k    message k and every later message, both ways, are lost (the link is cut)
                                                     after send time + delay (clock seconds)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvtransport.base import KVReceiver, KVSender, TransportError
from kvtransport.events import TransferEvent, TransferFailed
from kvtransport.framing import Buffer
from pdwire.handshake import PeerIdentity
from kvtransport.payload import InlineSink, block_bytes
from kvtransport.receiver_core import ReceiverCore
from kvtransport.receiver_state import Reservation
from kvtransport.sender_core import SenderCore

SCHEME = "fake://"


class ManualClock:
    """A clock tests advance by hand: `clock.advance(5.0)`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class FaultPlan:
    drop: frozenset[int] = frozenset()
    duplicate: frozenset[int] = frozenset()
    corrupt: frozenset[int] = frozenset()
    delay: dict[int, float] = field(default_factory=dict)
    cut_at: int | None = None


class FakeNetwork:
    """The address book of one test: receivers by name, senders by peer name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.receivers: dict[str, FakeReceiver] = {}
        self.senders: dict[str, FakeSender] = {}


class FakeReceiver(KVReceiver):
    def __init__(self, network: FakeNetwork, name: str, kv_cache: torch.Tensor,
                 identity: PeerIdentity, secret: bytes, peer_timeout: float = 10.0) -> None:
        self.endpoint = SCHEME + name
        self._network = network
        self._core = ReceiverCore(kv_cache.shape[0], identity, secret, InlineSink(kv_cache, identity.layout),
                                  self._reply, peer_timeout, network.clock)
        self._delayed: list[tuple[float, str, list[bytes]]] = []
        self.metrics = self._core.metrics
        network.receivers[name] = self

    @property
    def ledger(self):
        return self._core.ledger

    def deliver(self, peer: str, frames: list[Buffer], delay: float = 0.0) -> None:
        """Hand one message to the receiver now, or after delay clock seconds."""
        if delay > 0:
            due = self._network.clock() + delay
            self._delayed.append((due, peer, [bytes(f) for f in frames]))
        else:
            self._core.handle(peer, frames)

    def register(self, reservation: Reservation) -> None:
        self._core.register(reservation)

    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        now = self._network.clock()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, peer, frames in sorted(due, key=lambda d: d[0]):
            self._core.handle(peer, frames)
        self._core.tick()
        return self._core.take_events()

    def abort(self, xfer_id: str, reason: str = "") -> None:
        self._core.abort(xfer_id, reason)

    def close(self) -> list[TransferEvent]:
        self._core.close()
        self._network.receivers.pop(self.endpoint.removeprefix(SCHEME), None)
        return self._core.take_events()

    def _reply(self, peer: str, frames: list[Buffer]) -> None:
        sender = self._network.senders.get(peer)
        if sender is not None:
            sender.on_reply(self.endpoint, frames)


class FakeSender(KVSender):
    def __init__(self, network: FakeNetwork, identity: PeerIdentity, secret: bytes,
                 faults: FaultPlan = FaultPlan(), heartbeat_interval: float = 1.0,
                 peer_timeout: float = 10.0) -> None:
        self.name = f"{identity.node_id}/{identity.epoch}"
        self._network, self._faults = network, faults
        self._core = SenderCore(identity, secret, heartbeat_interval, peer_timeout, network.clock)
        self.metrics = self._core.metrics
        self._inbox: list[tuple[str, list[Buffer]]] = []
        self._sent = 0          # messages sent after the handshake (the fault plan's index)
        network.senders[self.name] = self

    def connect(self, endpoint: str, timeout: float = 10.0) -> PeerIdentity:
        receiver = self._network.receivers.get(endpoint.removeprefix(SCHEME))
        if receiver is None or self._cut:
            raise TransportError(f"no receiver at {endpoint}")
        receiver.deliver(self.name, self._core.auth_hello(endpoint))
        receiver.deliver(self.name, self._core.on_challenge(endpoint, self._reply_from(endpoint)))
        return self._core.accept_ack(endpoint, self._reply_from(endpoint))

    def begin(self, xfer_id: str, endpoint: str) -> None:
        self._core.begin(xfer_id, endpoint)

    def send_block(self, xfer_id: str, index: int, dst_block_id: int, kv_cache: torch.Tensor,
                   src_block_id: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is None:
            return
        header = self._core.block_header(xfer_id, index, dst_block_id, kv_cache)
        self._transmit(endpoint, self._core.pack(endpoint, header, block_bytes(kv_cache, src_block_id)))
        self.metrics.blocks_sent += 1
        self.metrics.bytes_sent += header.nbytes

    def commit(self, xfer_id: str, first_token: int, num_tokens: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is not None:
            self._transmit(endpoint, self._core.commit_frames(xfer_id, first_token, num_tokens))

    def abort(self, xfer_id: str, reason: str = "") -> None:
        endpoint = self._core.endpoint_of(xfer_id) if self._core.is_open(xfer_id) else None
        if endpoint is not None:
            self._transmit(endpoint, self._core.abort_frames(xfer_id, reason))

    def is_sent(self, xfer_id: str) -> bool:
        return True

    def poll(self, timeout: float = 0.0) -> list[TransferFailed]:
        inbox, self._inbox = self._inbox, []
        for endpoint, frames in inbox:
            self._core.handle(endpoint, frames)
        for endpoint, frames in self._core.due_heartbeats():
            self._transmit(endpoint, frames)
        return self._core.take_events()

    def close(self) -> None:
        self._network.senders.pop(self.name, None)

    def send_raw(self, endpoint: str, frames: list[Buffer]) -> None:
        """Deliver arbitrary frames as this sender (hostile-peer tests); no fault plan."""
        self._network.receivers[endpoint.removeprefix(SCHEME)].deliver(self.name, frames)

    def seal(self, endpoint: str, msg, payload: Buffer | None = None) -> list[Buffer]:
        """msg sealed on this sender's session with endpoint (hostile-peer tests)."""
        return self._core.pack(endpoint, msg, payload)

    def _reply_from(self, endpoint: str) -> list[Buffer]:
        """The first reply waiting from endpoint during pairing; TransportError if none."""
        replies = [f for e, f in self._inbox if e == endpoint]
        self._inbox = [(e, f) for e, f in self._inbox if e != endpoint]
        if not replies:
            raise TransportError(f"{endpoint} did not answer")
        return replies[0]

    def on_reply(self, endpoint: str, frames: list[Buffer]) -> None:
        if not self._cut:
            self._inbox.append((endpoint, [bytes(f) for f in frames]))

    @property
    def _cut(self) -> bool:
        return self._faults.cut_at is not None and self._sent >= self._faults.cut_at

    def _transmit(self, endpoint: str, frames: list[Buffer]) -> None:
        k, plan = self._sent, self._faults
        if self._cut:
            return
        self._sent += 1
        receiver = self._network.receivers.get(endpoint.removeprefix(SCHEME))
        if receiver is None or k in plan.drop:
            return
        if k in plan.corrupt:
            frames = [bytes(frames[0])[: len(frames[0]) // 2], *frames[1:]]
        for _ in range(2 if k in plan.duplicate else 1):
            receiver.deliver(self.name, frames, plan.delay.get(k, 0.0))
