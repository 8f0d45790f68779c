"""ZmqReceiver: the Receiver on one ZMQ ROUTER socket (zmq_link.py), any number of prefill peers,
over TCP or IPC; it binds to 127.0.0.1 unless an address is given.

Each peer proves it holds the cluster secret before any of its messages is read
(kvtransport.session); a block's payload is copied once, from the socket buffer into its block.
It tells glibc to keep the frames libzmq frees (kvtransport.heap: process-wide) unless asked not to.
"""
from __future__ import annotations

import torch

from kvtransport.heap import retain_freed
from kvtransport.payload import InlineSink
from kvtransport.receiver import Receiver
from kvtransport.receiver_core import PayloadSink
from kvtransport.zmq_link import DEFAULT_BIND, MAX_POLL_S, MAX_SPLIT_HWM, ZmqReceiveLink, queue_hwm
from pdwire.handshake import PeerIdentity
from pdwire.messages import BATCH_BYTES, RECV_QUEUE_BYTES, SPLIT_PAYLOADS, announced_batch_bytes

__all__ = ["DEFAULT_BIND", "RECV_QUEUE_BYTES", "ZmqReceiver"]


class ZmqReceiver(Receiver):
    """Receives blocks from any number of ZmqSenders into `kv_cache`: straight in when its blocks
    are wire blocks (every kv head), else through `sink` (e.g. a BlockWriterSink).

    A peer may queue no more than max_queue_bytes of messages of the largest payload it may
    send in one: to a receiver that takes split payloads, one block (each payload a message of
    its own; libzmq's MAXMSGSIZE caps every frame at a block), so 256 MiB / the block bytes (at
    most MAX_SPLIT_HWM, and not capped by hwm: ZeroMQ counts messages, not bytes); else the
    max_batch_bytes it announces (WHOLE_BATCH_BYTES at most) or one block where that is larger,
    and hwm messages at most: 64 x 2 MiB by default. One message at least either way. retain_heap:
    keep the memory of received frames mapped for the next ones (kvtransport.heap), as much as
    the queue may hold. split_payloads: senders may send each payload of a batch as a message
    of its own, after the batch's [header, seal] (announced in the HelloAck). max_poll_s: the most a
    poll takes messages for, from its first (then it returns to the caller's loop)."""

    def __init__(self, kv_cache: torch.Tensor, identity: PeerIdentity, secret: bytes,
                 bind: str = DEFAULT_BIND, peer_timeout: float = 10.0, hwm: int = 64,
                 sink: PayloadSink | None = None, max_batch_bytes: int = BATCH_BYTES,
                 max_queue_bytes: int = RECV_QUEUE_BYTES, retain_heap: bool = True,
                 split_payloads: bool = SPLIT_PAYLOADS, max_poll_s: float = MAX_POLL_S) -> None:
        sink = sink or InlineSink(kv_cache, identity.layout)     # before the socket: may raise
        if max_queue_bytes < 1:
            raise ValueError(f"max_queue_bytes must be positive, got {max_queue_bytes}")
        split = split_payloads and sink.has_slots       # as ReceiverCore decides (this link lands)
        block_nbytes = identity.layout.block_nbytes
        message_bytes = block_nbytes if split else max(announced_batch_bytes(max_batch_bytes, False), block_nbytes)
        recv_hwm = queue_hwm(max_queue_bytes, message_bytes, MAX_SPLIT_HWM if split else hwm)
        if retain_heap:
            retain_freed((recv_hwm + 1) * message_bytes)     # the queue, and the message being read
        link = ZmqReceiveLink(secret, bind, hwm, block_nbytes, recv_hwm=recv_hwm, max_poll_s=max_poll_s)
        super().__init__(kv_cache.shape[0], identity, secret, link, sink, peer_timeout,
                         max_batch_bytes=max_batch_bytes, split_payloads=split_payloads)
