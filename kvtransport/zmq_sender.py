"""ZMQ send side: one DEALER socket per decode node, blocks sent zero-copy as [header, payload].

The payload frame aliases the pool block (copy=False) and carries a zmq tracker; is_sent()
is true once libzmq has released every payload of the transfer. The send high-water mark gives
backpressure: send_block blocks while `hwm` messages are queued for a peer, then raises
TransportError after `send_timeout` seconds. The routing id is node_id/<64 random bits> per
connect, so a restarted or reconnected sender is a new peer to the receiver, and no other process
can guess it to take the connection's place. Pairing authenticates the connection first
(kvtransport.session): every frame either way is sealed with its session's keys.
"""
from __future__ import annotations

import secrets
import time
from collections import defaultdict

import torch
import zmq

from kvtransport.base import KVSender, TransportError
from kvtransport.events import TransferFailed
from kvtransport.framing import Buffer
from pdwire.handshake import PeerIdentity
from pdwire.messages import BlockFrame
from kvtransport.payload import block_bytes
from kvtransport.sender_core import SenderCore


class ZmqSender(KVSender):
    """Ships blocks of one prefill node's pool to any number of ZmqReceivers."""

    def __init__(self, identity: PeerIdentity, secret: bytes, hwm: int = 64,
                 send_timeout: float = 10.0, heartbeat_interval: float = 1.0,
                 peer_timeout: float = 10.0) -> None:
        self._core = SenderCore(identity, secret, heartbeat_interval, peer_timeout)
        self.metrics = self._core.metrics
        self._hwm, self._send_timeout, self._peer_timeout = hwm, send_timeout, peer_timeout
        self._ctx = zmq.Context(io_threads=1)
        self._socks: dict[str, zmq.Socket] = {}
        self._remotes: dict[str, PeerIdentity] = {}
        self._pending: dict[str, list] = defaultdict(list)   # xfer_id -> payload completions

    def connect(self, endpoint: str, timeout: float = 10.0) -> PeerIdentity:
        if self._core.is_connected(endpoint):
            return self._remotes[endpoint]
        self._close_socket(endpoint)
        sock = self._open_socket(endpoint)
        deadline = time.monotonic() + timeout
        try:
            self._send(sock, self._core.auth_hello(endpoint), endpoint)
            challenge = self._reply(sock, endpoint, deadline)
            self._send(sock, self._core.on_challenge(endpoint, challenge), endpoint)
            remote = self._core.accept_ack(endpoint, self._reply(sock, endpoint, deadline))
            self._paired(endpoint, sock, remote, timeout)
        except BaseException:
            sock.close(linger=0)
            raise
        self._socks[endpoint], self._remotes[endpoint] = sock, remote
        return remote

    def begin(self, xfer_id: str, endpoint: str) -> None:
        self._core.begin(xfer_id, endpoint)

    def send_block(self, xfer_id: str, index: int, dst_block_id: int, kv_cache: torch.Tensor,
                   src_block_id: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is None:
            return
        start = time.perf_counter()
        header = self._core.block_header(xfer_id, index, dst_block_id, kv_cache)
        done = self._ship(endpoint, header, kv_cache, src_block_id)
        self._pending[xfer_id].append(done)
        self.metrics.blocks_sent += 1
        self.metrics.bytes_sent += header.nbytes
        self.metrics.send_seconds += time.perf_counter() - start

    def commit(self, xfer_id: str, first_token: int, num_tokens: int) -> None:
        endpoint = self._core.endpoint_of(xfer_id)
        if endpoint is not None:
            frames = self._core.commit_frames(xfer_id, first_token, num_tokens)
            self._send(self._socks[endpoint], frames, endpoint)

    def abort(self, xfer_id: str, reason: str = "") -> None:
        if self._core.is_open(xfer_id):
            endpoint = self._core.endpoint_of(xfer_id)
            self._send(self._socks[endpoint], self._core.abort_frames(xfer_id, reason), endpoint)

    def is_sent(self, xfer_id: str) -> bool:
        pending = [d for d in self._pending.get(xfer_id, ()) if not d.done]
        if pending:
            self._pending[xfer_id] = pending
        else:
            self._pending.pop(xfer_id, None)
        return not pending

    def poll(self, timeout: float = 0.0) -> list[TransferFailed]:
        deadline = time.monotonic() + timeout
        while True:
            self._read_replies(max(0.0, deadline - time.monotonic()))
            for endpoint, frames in self._core.due_heartbeats():
                self._try_send(endpoint, frames)
            events = self._core.take_events()
            self._close_lost_links()
            if events or time.monotonic() >= deadline:
                return events

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._close_socket(endpoint, linger=1.0)   # let a last Commit or Abort leave
        self._ctx.term()

    # -- hooks the torch.distributed sender overrides ------------------------------------------

    def _paired(self, endpoint: str, sock: zmq.Socket, remote: PeerIdentity, timeout: float) -> None:
        """The handshake with endpoint succeeded."""

    def _ship(self, endpoint: str, header: BlockFrame, kv_cache: torch.Tensor, src: int):
        """Send one block; returns a completion: anything with a `.done` bool (a zmq tracker)."""
        payload = zmq.Frame(block_bytes(kv_cache, src), copy=False, track=True)
        frames = self._core.pack(endpoint, header, payload.buffer)
        frames[1] = payload
        self._send(self._socks[endpoint], frames, endpoint)
        return payload.tracker

    def _unpaired(self, endpoint: str) -> None:
        """endpoint's link is gone."""

    # -- sockets ---------------------------------------------------------------------------------

    def _open_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"{self._core.identity.node_id}/{secrets.token_hex(8)}".encode())
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.SNDTIMEO, int(self._send_timeout * 1000))
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        return sock

    @staticmethod
    def _reply(sock: zmq.Socket, endpoint: str, deadline: float) -> list[bytes]:
        """The next message from endpoint during pairing; TransportError past the deadline."""
        if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            raise TransportError(f"{endpoint} did not answer the pairing in time")
        return sock.recv_multipart()

    def _send(self, sock: zmq.Socket, frames: list, endpoint: str) -> None:
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise TransportError(f"{endpoint} not draining: send blocked {self._send_timeout}s") from None

    def _try_send(self, endpoint: str, frames: list[Buffer]) -> None:
        try:
            self._socks[endpoint].send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass     # queue full: the blocks in it prove we are alive anyway

    def _read_replies(self, timeout: float) -> None:
        poller = zmq.Poller()
        for sock in self._socks.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout * 1000))) if self._socks else {}
        for endpoint, sock in list(self._socks.items()):
            while sock in ready:
                try:
                    self._core.handle(endpoint, sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if not self._socks and timeout > 0:
            time.sleep(timeout)

    def _close_lost_links(self) -> None:
        for endpoint in [e for e in self._socks if not self._core.is_connected(e)]:
            self._close_socket(endpoint)

    def _close_socket(self, endpoint: str, linger: float = 0.0) -> None:
        sock = self._socks.pop(endpoint, None)
        self._remotes.pop(endpoint, None)
        if sock is not None:
            self._unpaired(endpoint)
            sock.close(linger=int(linger * 1000))

