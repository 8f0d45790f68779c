"""The fake backend: a Sender and a Receiver over the in-process link (fake_link.py), so the
whole flow, failures included (FaultPlan), runs in CPU tests on a ManualClock."""
from __future__ import annotations

import torch

from kvtransport.fake_link import SCHEME, FakeNetwork, FakeReceiveLink, FakeSendLink, FaultPlan, ManualClock
from kvtransport.framing import Buffer
from kvtransport.payload import InlineSink
from kvtransport.payload_channel import InlineChannel
from kvtransport.receiver import Receiver
from kvtransport.receiver_core import PayloadSink
from kvtransport.sender import Sender
from pdwire.handshake import PeerIdentity
from pdwire.messages import BATCH_BYTES, Message

__all__ = ["SCHEME", "FakeNetwork", "FakeReceiver", "FakeSender", "FaultPlan", "ManualClock"]


class FakeReceiver(Receiver):
    """A Receiver named `name` on network (endpoint fake://name)."""

    def __init__(self, network: FakeNetwork, name: str, kv_cache: torch.Tensor,
                 identity: PeerIdentity, secret: bytes, peer_timeout: float = 10.0,
                 sink: PayloadSink | None = None, max_batch_bytes: int = BATCH_BYTES) -> None:
        sink = sink or InlineSink(kv_cache, identity.layout)
        super().__init__(kv_cache.shape[0], identity, secret, FakeReceiveLink(network, name), sink,
                         peer_timeout, network.clock, max_batch_bytes)

    def deliver(self, peer: str, frames: list[Buffer], delay: float = 0.0) -> None:
        """Hand one message to the receiver now, or after delay clock seconds."""
        self._link.deliver(peer, frames, delay)


class FakeSender(Sender):
    """A Sender on network whose messages after the handshake obey faults."""

    def __init__(self, network: FakeNetwork, identity: PeerIdentity, secret: bytes,
                 faults: FaultPlan = FaultPlan(), heartbeat_interval: float = 1.0,
                 peer_timeout: float = 10.0, max_batch_bytes: int = BATCH_BYTES) -> None:
        self.name = f"{identity.node_id}/{identity.epoch}"
        link = FakeSendLink(network, self.name, faults)
        super().__init__(identity, secret, link, InlineChannel(), heartbeat_interval, peer_timeout,
                         network.clock, max_batch_bytes)

    def send_raw(self, endpoint: str, frames: list[Buffer]) -> None:
        """Deliver arbitrary frames as this sender (hostile-peer tests); no fault plan."""
        self._link.send_raw(endpoint, frames)

    def seal(self, endpoint: str, msg: Message, *payloads: Buffer | None) -> list[Buffer]:
        """msg (and its payload frames; None for none) sealed on this sender's session with
        endpoint (hostile-peer tests)."""
        return self._core.pack(endpoint, msg, *(p for p in payloads if p is not None))
