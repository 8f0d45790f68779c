"""The in-process link: instant delivery by direct calls, with failure injection.

Frames go through the same sessions, Framer and cores as on a socket; only the socket is
replaced by a call. A FaultPlan acts on the messages a sender sends after its handshake,
numbered 0, 1, 2, ... (blocks, commits, aborts and heartbeats alike):

  drop        never delivered            duplicate   delivered twice
  corrupt     header cut to half (BAD_MAC)
  delay       delivered by the first poll() at or after send time + delay (clock seconds)
  cut_at=k    message k and every later message, both ways, are lost (the link is cut)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvtransport.base import TransportError
from kvtransport.link import Completion, DropHandler, Dropped, Handler, Lander, ReceiveLink, SendLink, Sent
from kvtransport.session import Buffer

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
    """The address book of one test: receive links by name, send links by sender name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.receivers: dict[str, FakeReceiveLink] = {}
        self.senders: dict[str, FakeSendLink] = {}


class FakeReceiveLink(ReceiveLink):
    def __init__(self, network: FakeNetwork, name: str) -> None:
        self.endpoint = SCHEME + name
        self._network, self._name = network, name
        self._handle: Handler = lambda peer, frames: None
        self._delayed: list[tuple[float, str, list[bytes]]] = []
        network.receivers[name] = self

    def bind(self, handle: Handler, lander: Lander | None = None) -> None:
        self._handle = handle

    def deliver(self, peer: str, frames: list[Buffer], delay: float = 0.0) -> None:
        """Hand one message to the receiver now, or after delay clock seconds."""
        if delay > 0:
            self._delayed.append((self._network.clock() + delay, peer, [bytes(f) for f in frames]))
        else:
            self._handle(peer, frames)

    def receive(self, timeout: float) -> None:
        now = self._network.clock()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, peer, frames in sorted(due, key=lambda d: d[0]):
            self._handle(peer, frames)
        if not due and timeout > 0:
            time.sleep(timeout)

    def send(self, peer: str, frames: list[Buffer]) -> None:
        sender = self._network.senders.get(peer)
        if sender is not None:
            sender.on_reply(self.endpoint, frames)

    def close(self) -> None:
        if self._network.receivers.get(self._name) is self:
            del self._network.receivers[self._name]


class FakeSendLink(SendLink):
    def __init__(self, network: FakeNetwork, name: str, faults: FaultPlan = FaultPlan()) -> None:
        self.name = name
        self._network, self._faults = network, faults
        self._inbox: list[tuple[str, list[Buffer]]] = []
        self._open: set[str] = set()
        self._paired: set[str] = set()     # the fault plan applies to these
        self._sent = 0          # messages sent after a handshake (the fault plan's index)
        network.senders[name] = self

    def open(self, endpoint: str) -> None:
        if self._receiver(endpoint) is None or self._cut:
            raise TransportError(f"no receiver at {endpoint}")
        self._open.add(endpoint)

    def recv(self, endpoint: str, timeout: float) -> list[Buffer] | Dropped | None:
        replies = [f for e, f in self._inbox if e == endpoint]
        self._inbox = [(e, f) for e, f in self._inbox if e != endpoint]
        return replies[0] if replies else None

    def paired(self, endpoint: str) -> None:
        self._paired.add(endpoint)

    def send(self, endpoint: str, frames: list[Buffer]) -> None:
        if endpoint in self._paired:
            self._transmit(endpoint, frames)
        else:
            self.send_raw(endpoint, frames)

    def send_tracked(self, endpoint: str, frames: list[Buffer]) -> Completion:
        self.send(endpoint, frames)
        return Sent()

    def try_send(self, endpoint: str, frames: list[Buffer]) -> None:
        self.send(endpoint, frames)

    def receive(self, timeout: float, handle: Handler, drop: DropHandler) -> None:
        inbox, self._inbox = self._inbox, []
        for endpoint, frames in inbox:
            handle(endpoint, frames)

    def endpoints(self) -> list[str]:
        return list(self._open)

    def close(self, endpoint: str, linger: float = 0.0) -> None:
        self._open.discard(endpoint)
        self._paired.discard(endpoint)

    def shutdown(self) -> None:
        self._network.senders.pop(self.name, None)

    def send_raw(self, endpoint: str, frames: list[Buffer]) -> None:
        """Deliver frames as this sender, outside the fault plan."""
        self._network.receivers[endpoint.removeprefix(SCHEME)].deliver(self.name, frames)

    def on_reply(self, endpoint: str, frames: list[Buffer]) -> None:
        if not self._cut:
            self._inbox.append((endpoint, [bytes(f) for f in frames]))

    @property
    def _cut(self) -> bool:
        return self._faults.cut_at is not None and self._sent >= self._faults.cut_at

    def _receiver(self, endpoint: str) -> FakeReceiveLink | None:
        return self._network.receivers.get(endpoint.removeprefix(SCHEME))

    def _transmit(self, endpoint: str, frames: list[Buffer]) -> None:
        k, plan = self._sent, self._faults
        if self._cut:
            return
        self._sent += 1
        receiver = self._receiver(endpoint)
        if receiver is None or k in plan.drop:
            return
        if k in plan.corrupt:
            frames = [bytes(frames[0])[: len(frames[0]) // 2], *frames[1:]]
        for _ in range(2 if k in plan.duplicate else 1):
            receiver.deliver(self.name, frames, plan.delay.get(k, 0.0))
