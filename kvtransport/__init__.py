"""kvtransport: ships paged KV blocks from prefill nodes straight into decode nodes' reserved blocks.

    (the messages, their schema and the handshake's identities live in pdwire, the wire
    vocabulary that imports neither torch nor this package)
    session.py         authenticated sessions: nonces, per-direction keys, sealed trailers, replay window
    secret.py          the cluster secret from a 0600 file or PDSERVE_CLUSTER_SECRET
    zmtp_auth.py       ZMTP PLAIN (zmq.auth ZAP handler) on the bound sockets: a peer without the
                       secret's password is refused before libzmq buffers any of its messages;
                       PLAIN's password travels in clear, so this gate stops only peers that
                       cannot see the traffic, and the session's MAC stays the real check;
                       it gives each connection a User-Id, so sessions are keyed by connection
    framing.py         a message as sealed frames [header, payload?, trailer]; control_framer()
    state.py           TransferState: RESERVED -> TRANSFERRING -> COMMITTED | FAILED
    events.py          TransferCommitted / TransferFailed, FailReason
    metrics.py         ReceiverMetrics / SenderMetrics counters, DropReason
    log_limiter.py     LogLimiter: warnings about what peers send, one a (peer, reason) per 10 s
    receiver_state.py  Reservation and ReceiveLedger: frame checks, leases, exactly-once outcomes
    receiver_core.py   receive side shared by backends: handshake, dispatch, peer liveness, PayloadSink
    sender_core.py     send side shared by backends: links, open transfers, heartbeats
    payload.py         a block's raw bytes, zero-copy out of and straight into the pool; the sinks
    base.py            KVSender / KVReceiver interfaces and the node-facing lifecycle
    sender.py          Sender: the one send flow, over a SendLink and a PayloadChannel
    receiver.py        Receiver: the one receive flow, over a ReceiveLink and a PayloadSink
    link.py            SendLink / ReceiveLink: the link strategies' contracts
    zmq_link.py        one ROUTER (TCP or IPC): payloads received straight into the pool, bounded drains
    zmq_send_link.py   DEALER per decode node (zero-copy, HWM backpressure); small replies, served in turn
    fake_link.py       in-process delivery with FaultPlan injection, ManualClock
    payload_channel.py PayloadChannel: inline frames, or out of band (torch_dist.DistChannel)
    zmq_sender.py      ZmqSender    = Sender(zmq link, inline payloads)
    zmq_receiver.py    ZmqReceiver  = Receiver(zmq link, InlineSink / BlockWriterSink)
    heap.py            glibc told to keep the frames libzmq frees (no page faults per received block)
    stream_copy.py     a landed block into its cold pool slot with streaming stores (kernels/csrc/stream_copy.c)
    torch_dist.py      DistSender / DistReceiver: zmq link, payloads over NCCL / gloo pair groups
    fake.py            FakeSender / FakeReceiver: fake link, instant, for CPU tests
    factory.py         make_sender / make_receiver by transport name
    testing.py         pools and identities for tests and benchmarks
"""
import importlib

# Names load on first use, so a process that needs only the session or the metrics does not
# import torch (base, payload and the backends do).
_LAZY = {
    "kvtransport.base": ("KVReceiver", "KVSender", "TransportError"),
    "kvtransport.events": ("FailReason", "TransferCommitted", "TransferEvent", "TransferFailed"),
    "kvtransport.metrics": ("DropReason", "ReceiverMetrics", "SenderMetrics"),
    "kvtransport.receiver_state": ("Reservation",),
    "kvtransport.state": ("IllegalTransition", "TransferState"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'kvtransport' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
