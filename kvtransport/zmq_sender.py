"""ZmqSender: the Sender over ZMQ DEALER sockets, payloads inline and zero-copy (zmq_link.py).

is_sent() is true once libzmq has released every payload of the transfer; send_block blocks
while `hwm` messages are queued for a peer (a sender that splits: hwm batches of the most
payloads, each a message, so a split batch queues as many bytes as a whole one; they alias pool
blocks, so the queue costs no copy), then raises TransportError after `send_timeout`.
Pairing authenticates the connection first (kvtransport.session): every frame either way is
sealed with its session's keys.
"""
from __future__ import annotations

from kvtransport.payload_channel import InlineChannel
from kvtransport.sender import Sender
from kvtransport.zmq_link import MAX_POLL_S, MAX_SPLIT_HWM
from kvtransport.zmq_send_link import ZmqSendLink
from pdwire.handshake import PeerIdentity
from pdwire.messages import BATCH_BYTES, MAX_BATCH_BLOCKS


class ZmqSender(Sender):
    """Ships blocks of one prefill node's pool to any number of ZmqReceivers."""

    def __init__(self, identity: PeerIdentity, secret: bytes, hwm: int = 64,
                 send_timeout: float = 10.0, heartbeat_interval: float = 1.0,
                 peer_timeout: float = 10.0, max_batch_bytes: int = BATCH_BYTES, split_payloads: bool = True,
                 max_poll_s: float = MAX_POLL_S) -> None:
        """max_poll_s: the most a poll takes replies for, from its first."""
        send_hwm = min(hwm * (MAX_BATCH_BLOCKS + 1), MAX_SPLIT_HWM) if split_payloads else hwm
        link = ZmqSendLink(identity.node_id, secret, hwm, send_timeout, max(hwm, send_hwm), max_poll_s)
        super().__init__(identity, secret, link, InlineChannel(), heartbeat_interval, peer_timeout,
                         max_batch_bytes=max_batch_bytes, split_payloads=split_payloads)
