"""The transport interface: a KVSender on each prefill node, a KVReceiver on each decode node
(which also makes a KVSender when it moves a running request to another decode node: the same
steps below, with the moving decode node in P's place).

  decode node D                                   prefill node P
  1. recv.register(Reservation(xfer_id, dst_block_ids, cached_prefix_blocks))
                                                   2. send.connect(D endpoint)      (once per D;
                                                      try_connect on a loop)
                                                   3. send.begin(xfer_id, D endpoint)  (queued)
                                                   4. send.send_blocks(...)  per step's finished blocks
                                                   5. send.commit(xfer_id, first_token, n)
  6. recv.poll() -> [TransferCommitted]  adopt dst_block_ids into the sequence's block table
     or            [TransferFailed]     free the reserved blocks (exactly one event per xfer)

Both sides call poll() from their loop at least every heartbeat interval: it moves frames,
sends heartbeats, expires leases and detects dead peers; a loop with nothing else to do sleeps on
waitables() (beside its own sockets) between polls. Neither class is thread-safe.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from kvtransport.events import TransferEvent, TransferFailed
from pdwire.handshake import PeerIdentity
from kvtransport.metrics import ReceiverMetrics, SenderMetrics
from kvtransport.receiver_state import Reservation

if TYPE_CHECKING:
    import zmq


class TransportError(RuntimeError):
    """The transport cannot do what was asked: peer unreachable, refused, or not draining."""


class KVSender(ABC):
    """Ships blocks `kv_cache: [num_blocks, L, 2, block_size, H, D]` with every kv head: this node's
    pool at tp = 1, a gathered copy of its ranks' heads at tp > 1 (TPModelRunner.gather_blocks)."""

    metrics: SenderMetrics

    def blocks_per_message(self, endpoint: str, nbytes: int | None = None) -> int | None:
        """How many items of nbytes (default: one whole block) one message to the paired endpoint
        carries, or None if this sender does not pack several per message."""
        return None

    @abstractmethod
    def connect(self, endpoint: str, timeout: float = 10.0) -> PeerIdentity:
        """Pair with the receiver at endpoint (idempotent); returns its identity.

        Raises HandshakeError naming the field if the layouts differ, TransportError if the
        peer refuses or does not answer within timeout (also when it joins a pairing that
        try_connect started), a backend's RuntimeError if its payload channel cannot be set up.
        """

    def try_connect(self, endpoint: str, timeout: float = 10.0) -> PeerIdentity | None:
        """connect() a step at a time, for a node's loop: never waits for the receiver's replies.

        Returns its identity once paired, None while the pairing is under way (call again, e.g.
        on the loop's next tick, to move it on). The first call starts it; a later one raises as
        connect() would once it fails or timeout has passed since it started (a failed pairing is
        forgotten: the next call starts a new one). torch_dist's last step still blocks, briefly:
        see kvtransport.sender. This default pairs
        in one call (up to timeout), for a backend that has no steps."""
        return self.connect(endpoint, timeout)

    @abstractmethod
    def begin(self, xfer_id: str, endpoint: str) -> None:
        """Take charge of xfer_id for the connected receiver at endpoint.

        From now on heartbeats name xfer_id, which renews its lease on the receiver while the
        prompt waits in this node's queue. Raises ValueError if xfer_id is already open.
        """

    @abstractmethod
    def send_block(self, xfer_id: str, index: int, dst_block_id: int, kv_cache: torch.Tensor,
                   src_block_id: int) -> None:
        """Ship kv_cache[src_block_id] into the receiver's block dst_block_id (block `index`).
        ValueError if kv_cache's blocks are not the identity's layout (e.g. one tp rank's heads).

        Does not copy on CPU: the source block must stay unchanged until is_sent(xfer_id).
        Blocks only while the transport's high-water mark is reached, then raises
        TransportError after the send timeout: that receiver is lost, its open transfers fail
        (poll returns them). A no-op if xfer_id already failed (its TransferFailed event was or
        will be returned by poll); KeyError if never begun.
        """

    def send_blocks(self, xfer_id: str, indices: list[int], dst_block_ids: list[int],
                    kv_cache: torch.Tensor, src_block_ids: list[int]) -> None:
        """send_block for each (index, dst, src) of blocks ready together; a backend that can
        ships them several to a message (BlockBatch). Same contract as send_block."""
        for index, dst, src in zip(indices, dst_block_ids, src_block_ids):
            self.send_block(xfer_id, index, dst, kv_cache, src)

    def takes_layers(self, xfer_id: str) -> bool:
        """Whether send_layers works for xfer_id (its receiver takes layer slices)."""
        return False

    def send_layers(self, xfer_id: str, indices: list[int], dst_block_ids: list[int], kv_cache: torch.Tensor,
                    src_block_ids: list[int], first_layer: int, num_layers: int) -> None:
        """Ship layers [first_layer, first_layer + num_layers) of blocks ready together (a layer
        group a forward has just finished; the receiver takes a block once all its layers came).
        Only if takes_layers(xfer_id); otherwise the same contract as send_block."""
        raise NotImplementedError(f"{type(self).__name__} does not ship layer slices")

    @abstractmethod
    def commit(self, xfer_id: str, first_token: int, num_tokens: int) -> None:
        """Send the Commit after the last block; the transfer is closed on this side. A no-op if
        xfer_id failed; TransportError as send_block's, if the receiver's queue is full."""

    @abstractmethod
    def abort(self, xfer_id: str, reason: str = "") -> None:
        """Tell the receiver to fail xfer_id; closed on this side. No-op if not open;
        TransportError as send_block's, if the receiver's queue is full."""

    @abstractmethod
    def is_sent(self, xfer_id: str) -> bool:
        """True once every payload of xfer_id has left this process (source blocks reusable)."""

    def waitables(self) -> list[zmq.Socket]:
        """Sockets that turn readable when a receiver replies (pairing steps included), for a node's
        loop to wait on beside its own, then poll(0.0) (and try_connect); none for a backend without
        sockets. No socket says when a payload has left (is_sent): look again soon for that."""
        return []

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> list[TransferFailed]:
        """Read replies, send due heartbeats, detect dead receivers; wait at most timeout.

        Returns one TransferFailed per open transfer the receiver aborted or lost.
        """

    @abstractmethod
    def close(self) -> None:
        """Release sockets and groups; open transfers are abandoned (receivers time them out)."""


class KVReceiver(ABC):
    """Receives blocks (every kv head) into reserved blocks of `kv_cache: [num_blocks, L, 2, bs, H, D]`:
    straight in, or through a sink that maps heads when the pool holds a tp rank's share."""

    endpoint: str                     # where senders connect
    metrics: ReceiverMetrics

    @abstractmethod
    def register(self, reservation: Reservation) -> None:
        """Expect reservation's blocks. ValueError if its id is reused or a block is already
        reserved by a live transfer or outside the pool."""

    def waitables(self) -> list[zmq.Socket]:
        """Sockets that turn readable when a message arrives, for a node's loop to wait on beside its
        own, then poll(0.0): every frame comes through them (torch_dist's payloads follow their
        headers, which do). None for a backend without sockets (the fake one): poll it."""
        return []

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> list[TransferEvent]:
        """Receive and write frames for up to timeout seconds, expire leases and dead peers.

        Returns finished transfers: each registered xfer_id appears exactly once, as
        TransferCommitted (adopt its blocks) or TransferFailed (free them).
        """

    @abstractmethod
    def abort(self, xfer_id: str, reason: str = "") -> None:
        """Fail xfer_id (its TransferFailed comes from the next poll) and tell the sender."""

    @abstractmethod
    def close(self) -> list[TransferEvent]:
        """Release the socket; returns a TransferFailed (CLOSED) for every live transfer."""
