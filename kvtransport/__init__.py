"""kvtransport: ships paged KV blocks from prefill nodes straight into decode nodes' reserved blocks.

    schema.py          protocol version, limits, field checks, ProtocolError
    handshake.py       KVLayout, PeerIdentity, model_fingerprint, check_compatible (names the field)
    messages.py        every cross-process message as a dataclass; msgpack encode / decode
    framing.py         a message as frames [header, payload?, mac?]; HMAC-SHA256 auth
    state.py           TransferState: RESERVED -> TRANSFERRING -> COMMITTED | FAILED
    events.py          TransferCommitted / TransferFailed, FailReason
    metrics.py         ReceiverMetrics / SenderMetrics counters, DropReason
    receiver_state.py  Reservation and ReceiveLedger: frame checks, leases, exactly-once outcomes
    receiver_core.py   receive side shared by backends: handshake, dispatch, peer liveness
    sender_core.py     send side shared by backends: links, open transfers, heartbeats
    payload.py         a block's raw bytes, zero-copy out of and straight into the pool
    base.py            KVSender / KVReceiver interfaces and the node-facing lifecycle
    zmq_sender.py      ZmqSender    (DEALER per decode node, zero-copy, HWM backpressure)
    zmq_receiver.py    ZmqReceiver  (one ROUTER, TCP or IPC, loopback by default)
    torch_dist.py      DistSender / DistReceiver: control over ZMQ, payloads over NCCL / gloo
    fake.py            FakeSender / FakeReceiver: in-process, instant, with FaultPlan injection
    testing.py         pools and identities for tests and benchmarks
"""
from kvtransport.base import KVReceiver, KVSender, TransportError
from kvtransport.events import FailReason, TransferCommitted, TransferEvent, TransferFailed
from kvtransport.handshake import (HandshakeError, KVLayout, PeerIdentity, check_compatible,
                                   model_fingerprint, new_epoch)
from kvtransport.messages import (Abort, BlockFrame, Busy, Commit, Heartbeat, Hello, HelloAck,
                                  P2PJoin, Reserve, Reserved, decode, encode)
from kvtransport.metrics import DropReason, ReceiverMetrics, SenderMetrics
from kvtransport.receiver_state import Reservation
from kvtransport.schema import PROTOCOL_VERSION, ProtocolError
from kvtransport.state import IllegalTransition, TransferState

__all__ = [
    "KVReceiver", "KVSender", "TransportError", "FailReason", "TransferCommitted", "TransferEvent",
    "TransferFailed", "HandshakeError", "KVLayout", "PeerIdentity", "check_compatible",
    "model_fingerprint", "new_epoch", "Abort", "BlockFrame", "Busy", "Commit", "Heartbeat", "Hello",
    "HelloAck", "P2PJoin", "Reserve", "Reserved", "decode", "encode", "DropReason",
    "ReceiverMetrics", "SenderMetrics", "Reservation", "PROTOCOL_VERSION", "ProtocolError",
    "IllegalTransition", "TransferState",
]
