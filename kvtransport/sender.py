"""The send side's flow, one for every backend: a SenderCore over a link and a payload channel.

  connect   link.open -> auth hello / challenge / Hello / HelloAck (kvtransport.session) ->
            [the channel's join message, e.g. P2PJoin] -> channel.paired (e.g. join the pair's
            process group) -> link.paired; try_connect takes it a step per call, never waiting
            for the receiver's replies. Only the last step may block: torch_dist's group join
            (TCPStore connect, then gloo rendezvous) gets what is left of the pairing's timeout,
            at most torch_dist.MAX_JOIN_S (3 s; the TCPStore's connect retries can overrun it,
            by about its retry delay: see there); other channels' paired() does not block
  send      header sealed by the core; the payload inline (tracked, zero-copy) or out of band;
            blocks ready together go up to batch_blocks() to a BlockBatch on a batching channel,
            within this sender's max_batch_bytes and the receiver's (its HelloAck); a layer group's
            slices of blocks (send_layers) go as LayerBatch messages the same way, to receivers
            whose HelloAck says they take them; a send that times out (a receiver that stopped
            draining) loses that receiver: its transfers fail, none waits on its queue again
  poll      broken channels lose their link; replies go to the core; due heartbeats leave;
            connections of lost links are closed

Backends differ only in the strategies they are built from (kvtransport.factory):
ZmqSender (zmq link, inline), DistSender (zmq link, torch.distributed), FakeSender (fake link, inline).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Generator

import torch

from kvtransport.base import KVSender, TransportError
from kvtransport.events import FailReason, TransferFailed
from kvtransport.link import Completion, Dropped, SendLink
from kvtransport.payload_channel import PayloadChannel
from kvtransport.sender_core import SenderCore
from pdwire.handshake import PeerIdentity
from pdwire.messages import BATCH_BYTES, BlockBatch, BlockFrame, LayerBatch, batch_blocks

if TYPE_CHECKING:
    import zmq

Pairing = Generator[None, "float | None", PeerIdentity]    # a handshake's steps: send() each its wait


class Sender(KVSender):
    """Ships blocks of one prefill node's pool to any number of receivers."""

    def __init__(self, identity: PeerIdentity, secret: bytes, link: SendLink, channel: PayloadChannel,
                 heartbeat_interval: float = 1.0, peer_timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_batch_bytes: int = BATCH_BYTES,
                 split_payloads: bool = True) -> None:
        """max_batch_bytes: the payload bytes this sender packs into one BlockBatch, at most what
        each receiver announced in its HelloAck (one block at least); split_payloads: send them as
        messages of their own to receivers that take them (False: one message a batch, each send
        one message under one send timeout, as a loop with a deadline needs: decode_node.mover)."""
        self._core = SenderCore(identity, secret, heartbeat_interval, peer_timeout, clock, split_payloads)
        self._max_batch_bytes = max_batch_bytes
        self._link, self._channel = link, channel
        self.metrics = self._core.metrics
        self._remotes: dict[str, PeerIdentity] = {}
        self._pending: dict[str, list[Completion]] = defaultdict(list)   # xfer_id -> payloads in flight
        self._pairings: dict[str, Pairing] = {}      # endpoint -> its handshake under way (_pair)

    def connect(self, endpoint: str, timeout: float = 10.0) -> PeerIdentity:
        deadline = time.monotonic() + timeout       # also for a pairing try_connect started earlier
        remote = self.try_connect(endpoint, timeout)
        while remote is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._forget(endpoint)
                raise TransportError(f"{endpoint} did not answer the pairing in time")
            remote = self._advance(endpoint, left)
        return remote

    def try_connect(self, endpoint: str, timeout: float = 10.0) -> PeerIdentity | None:
        if endpoint in self._remotes and self._core.is_connected(endpoint):
            return self._remotes[endpoint]
        if endpoint not in self._pairings:
            self._close(endpoint)
            self._link.open(endpoint)
            self._pairings[endpoint] = self._pair(endpoint, timeout)
            self._advance(endpoint, None)       # the hello leaves
        return self._advance(endpoint, 0.0)

    def begin(self, xfer_id: str, endpoint: str) -> None:
        self._core.begin(xfer_id, endpoint)

    def send_block(self, xfer_id: str, index: int, dst_block_id: int, kv_cache: torch.Tensor,
                   src_block_id: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is None:
            return
        start = time.perf_counter()
        header = self._core.block_header(xfer_id, index, dst_block_id, kv_cache)
        self._pending[xfer_id].append(self._ship(endpoint, header, kv_cache, src_block_id))
        self.metrics.blocks_sent += 1
        self.metrics.bytes_sent += header.nbytes
        self.metrics.send_seconds += time.perf_counter() - start

    def send_blocks(self, xfer_id: str, indices: list[int], dst_block_ids: list[int],
                    kv_cache: torch.Tensor, src_block_ids: list[int]) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is None:
            return
        if not self._channel.batches:
            return super().send_blocks(xfer_id, indices, dst_block_ids, kv_cache, src_block_ids)
        self._send_batches(xfer_id, endpoint, self._core.identity.layout.block_nbytes, len(indices), lambda k, j: (
            self._core.batch_header(xfer_id, indices[k:j], dst_block_ids[k:j], kv_cache),
            self._channel.inline_many(kv_cache, src_block_ids[k:j])))

    def takes_layers(self, xfer_id: str) -> bool:
        endpoint = self._core.endpoint_of(xfer_id)
        return endpoint is not None and self._channel.batches and self._core.takes_layers(endpoint)

    def send_layers(self, xfer_id: str, indices: list[int], dst_block_ids: list[int], kv_cache: torch.Tensor,
                    src_block_ids: list[int], first_layer: int, num_layers: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is None:
            return
        if not self.takes_layers(xfer_id):
            raise TransportError(f"{endpoint} takes no layer slices")
        layout = self._core.identity.layout
        self._send_batches(xfer_id, endpoint, layout.block_nbytes // layout.num_layers * num_layers, len(indices),
                           lambda k, j: (
            self._core.layer_header(xfer_id, indices[k:j], dst_block_ids[k:j], kv_cache, first_layer, num_layers),
            self._channel.inline_many(kv_cache, src_block_ids[k:j], first_layer, num_layers)))

    def _send_batches(self, xfer_id: str, endpoint: str, nbytes: int, n: int,
                      make: Callable[[int, int], tuple[BlockBatch | LayerBatch, list[memoryview]]]) -> None:
        """Items [0, n) of nbytes each as batches of up to both sides' batch bytes; make(k, j) is
        the header and payload frames of items [k, j). Only the last message is tracked."""
        step = self.blocks_per_message(endpoint, nbytes)
        for k in range(0, n, step):
            start = time.perf_counter()
            header, payloads = make(k, min(n, k + step))
            frames = self._core.pack(endpoint, header, *payloads)
            if k + step >= n:    # a link releases its messages in order: one tracker covers all
                self._pending[xfer_id].append(self._post(endpoint, frames, tracked=True))
            else:
                self._post(endpoint, frames)
            if type(header) is BlockBatch or header.first_layer == 0:   # a sliced block counts once
                self.metrics.blocks_sent += len(header.indices)
            self.metrics.bytes_sent += header.nbytes * len(header.indices)
            self.metrics.send_seconds += time.perf_counter() - start

    def blocks_per_message(self, endpoint: str, nbytes: int | None = None) -> int:
        """Items of nbytes (default: one whole block) per message to endpoint: up to both sides'
        batch bytes, at least one."""
        nbytes = self._core.identity.layout.block_nbytes if nbytes is None else nbytes
        return batch_blocks(nbytes, min(self._max_batch_bytes, self._core.batch_bytes(endpoint)))

    def commit(self, xfer_id: str, first_token: int, num_tokens: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is not None:
            self._send(endpoint, self._core.commit_frames(xfer_id, first_token, num_tokens))

    def abort(self, xfer_id: str, reason: str = "") -> None:
        if self._core.is_open(xfer_id):
            endpoint = self._core.endpoint_of(xfer_id)
            self._send(endpoint, self._core.abort_frames(xfer_id, reason))

    def is_sent(self, xfer_id: str) -> bool:
        pending = [d for d in self._pending.get(xfer_id, ()) if not d.done]
        if pending:
            self._pending[xfer_id] = pending
        else:
            self._pending.pop(xfer_id, None)
        return not pending

    def waitables(self) -> list[zmq.Socket]:
        return self._link.waitables()

    def poll(self, timeout: float = 0.0) -> list[TransferFailed]:
        for endpoint, error in self._channel.broken():
            if self._core.is_connected(endpoint):
                self._core.lost(endpoint, FailReason.CHANNEL_BROKEN, error)
        deadline = time.monotonic() + timeout
        while True:
            self._link.receive(max(0.0, deadline - time.monotonic()), self._core.handle, self._core.dropped)
            for endpoint, frames in self._core.due_heartbeats():
                self._link.try_send(endpoint, frames)
            events = self._core.take_events()
            for endpoint in [e for e in self._link.endpoints()
                             if not self._core.is_connected(e) and e not in self._pairings]:
                self._close(endpoint)
            if events or time.monotonic() >= deadline:
                return events

    def close(self) -> None:
        for endpoint in self._link.endpoints():
            self._close(endpoint, linger=1.0)     # let a last Commit or Abort leave
        self._link.shutdown()

    def _pair(self, endpoint: str, timeout: float) -> Pairing:
        """The handshake over endpoint's new connection, as steps (_advance); returns the
        receiver's identity, paired."""
        deadline = time.monotonic() + timeout
        self._link.send(endpoint, self._core.auth_hello(endpoint))
        challenge = yield from self._reply(endpoint, deadline)
        self._link.send(endpoint, self._core.on_challenge(endpoint, challenge))
        remote = self._core.accept_ack(endpoint, (yield from self._reply(endpoint, deadline)))
        join = self._core.unpack(endpoint, (yield from self._reply(endpoint, deadline))) if self._channel.joins else None
        self._channel.paired(endpoint, remote, join, max(0.0, deadline - time.monotonic()))
        self._link.paired(endpoint)
        self._remotes[endpoint] = remote
        return remote

    def _reply(self, endpoint: str, deadline: float) -> Generator[None, float, list]:
        """The receiver's next message: each step waits up to the seconds sent to it; one the link
        dropped is counted, and the next one waited for."""
        while True:
            wait = yield
            frames = self._link.recv(endpoint, max(0.0, min(wait, deadline - time.monotonic())))
            if type(frames) is Dropped:
                self._core.dropped(endpoint, frames)
            elif frames is not None:
                return frames
            if time.monotonic() >= deadline:
                raise TransportError(f"{endpoint} did not answer the pairing in time")

    def _advance(self, endpoint: str, wait: float | None) -> PeerIdentity | None:
        """One step of the pairing with endpoint, waiting up to wait s (None: its first step);
        the receiver's identity once paired. A failed pairing is forgotten, its connection
        closed, and raises."""
        try:
            self._pairings[endpoint].send(wait)
            return None
        except StopIteration as paired:
            del self._pairings[endpoint]
            return paired.value
        except BaseException:
            self._forget(endpoint)
            raise

    def _forget(self, endpoint: str) -> None:
        """A failed pairing: the core may have recorded the link (accept_ack), the link is open."""
        self._core.forget(endpoint)
        self._close(endpoint)

    def _ship(self, endpoint: str, header: BlockFrame, kv_cache: torch.Tensor, src: int) -> Completion:
        payload = self._channel.inline(kv_cache, src)
        if payload is not None:
            return self._post(endpoint, self._core.pack(endpoint, header, payload), tracked=True)
        self._send(endpoint, self._core.pack(endpoint, header))
        return self._channel.send(endpoint, kv_cache, src)

    def _post(self, endpoint: str, frames: list, tracked: bool = False) -> Completion | None:
        """Send the packed message frames ([header, seal, *payloads] as [header, seal] and a message
        per payload to a receiver that splits); tracked: its last message, whose completion covers
        every message before it on the connection."""
        if len(frames) < 3 or not self._core.splits(endpoint):
            return self._send(endpoint, frames, tracked)
        self._send(endpoint, frames[:2])
        self._send(endpoint, frames[2:-1], each=True)
        return self._send(endpoint, frames[-1:], tracked)

    def _send(self, endpoint: str, frames: list, tracked: bool = False, each: bool = False) -> Completion | None:
        """One message to the paired endpoint (tracked: the Completion of its release; each: every
        frame a message of its own). A send that times out (the receiver stopped draining) raises
        TransportError and loses endpoint: its other transfers fail at once (PEER_DEAD) instead of
        each holding the caller for the send timeout again, and their Aborts are not sent into the
        full queue."""
        try:
            if each:
                return self._link.send_each(endpoint, frames)
            return self._link.send_tracked(endpoint, frames) if tracked else self._link.send(endpoint, frames)
        except TransportError as err:
            if self._core.is_connected(endpoint):
                self._core.lost(endpoint, FailReason.PEER_DEAD, str(err))
            raise

    def _close(self, endpoint: str, linger: float = 0.0) -> None:
        self._remotes.pop(endpoint, None)
        self._pairings.pop(endpoint, None)
        if endpoint in self._link.endpoints():
            self._channel.unpaired(endpoint)
        self._link.close(endpoint, linger)
