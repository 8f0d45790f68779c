"""The one place a transport's name becomes a sender or a receiver; nodes never branch on it.

    transport    sender        receiver       link            payloads
    "zmq"        ZmqSender     ZmqReceiver    ZMQ sockets     inline frames
    "torch_dist" DistSender    DistReceiver   ZMQ sockets     torch.distributed pair groups
    "fake"       FakeSender    FakeReceiver   in-process      inline frames (tests)

Options are the backend's keyword arguments. An option that only another transport takes is
ignored (a node passes its whole set, e.g. p2p_host); any other name is a TypeError.
`write_blocks` (a pool holding some of the kv heads) becomes each receiver's sink.
"""
from __future__ import annotations

import importlib
from typing import Any

from kvtransport.base import KVReceiver, KVSender
from pdwire.handshake import PeerIdentity

TRANSPORTS = ("zmq", "torch_dist", "fake")

_SENDERS: dict[str, tuple[str, str, frozenset[str]]] = {    # transport -> (module, class, options)
    "zmq": ("kvtransport.zmq_sender", "ZmqSender",
            frozenset({"hwm", "send_timeout", "heartbeat_interval", "peer_timeout", "max_batch_bytes",
                       "split_payloads", "max_poll_s"})),
    "torch_dist": ("kvtransport.torch_dist", "DistSender",
                   frozenset({"hwm", "send_timeout", "heartbeat_interval", "peer_timeout", "device", "p2p_host"})),
    "fake": ("kvtransport.fake", "FakeSender",
             frozenset({"network", "faults", "heartbeat_interval", "peer_timeout", "max_batch_bytes"})),
}
_RECEIVERS: dict[str, tuple[str, str, frozenset[str]]] = {
    "zmq": ("kvtransport.zmq_receiver", "ZmqReceiver",
            frozenset({"bind", "peer_timeout", "hwm", "sink", "write_blocks", "max_batch_bytes",
                       "max_queue_bytes", "retain_heap", "split_payloads", "max_poll_s"})),
    "torch_dist": ("kvtransport.torch_dist", "DistReceiver",
                   frozenset({"bind", "peer_timeout", "hwm", "p2p_host", "write_blocks", "payload_wait_s"})),
    "fake": ("kvtransport.fake", "FakeReceiver",
             frozenset({"network", "name", "peer_timeout", "sink", "write_blocks", "max_batch_bytes"})),
}


def make_sender(transport: str, identity: PeerIdentity, secret: bytes, **options: Any) -> KVSender:
    """The sender of `transport`; ValueError for an unknown transport."""
    cls, kwargs = _pick(_SENDERS, transport, options)
    return cls(identity=identity, secret=secret, **kwargs)


def make_receiver(transport: str, kv_cache, identity: PeerIdentity, secret: bytes,
                  **options: Any) -> KVReceiver:
    """The receiver of `transport` for kv_cache [num_blocks, L, 2, block_size, H, D]."""
    cls, kwargs = _pick(_RECEIVERS, transport, options)
    write_blocks = kwargs.get("write_blocks")
    if transport != "torch_dist" and "write_blocks" in kwargs:
        del kwargs["write_blocks"]
        if write_blocks is not None:
            from kvtransport.payload import BlockWriterSink
            kwargs["sink"] = BlockWriterSink(write_blocks, identity.layout)
    return cls(kv_cache=kv_cache, identity=identity, secret=secret, **kwargs)


def _pick(table: dict[str, tuple[str, str, frozenset[str]]], transport: str,
          options: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The backend class of transport and the options it takes."""
    if transport not in table:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    module, name, takes = table[transport]
    known = frozenset().union(*(t[2] for t in table.values()))
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown transport options {unknown}")
    return getattr(importlib.import_module(module), name), {k: v for k, v in options.items() if k in takes}
