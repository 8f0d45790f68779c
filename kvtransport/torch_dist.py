"""torch.distributed backend: control over ZMQ, block payloads as point-to-point tensors.

Each prefill/decode pair gets its own two-rank process group (D rank 0, P rank 1), NCCL for
CUDA pools and gloo for CPU pools, so one decode node can pair with many prefill nodes:

  1. P -> D  Hello over ZMQ            D checks the layout, answers HelloAck
  2. D -> P  P2PJoin(group, store)     D hosts a TCPStore (listening on loopback unless
                                       p2p_host is given); both build the pair's group on it,
                                       D on a thread (_PairJoin) while its loop goes on
  3. P -> D  BlockFrame header (ZMQ), then the block as a tensor send (group)
     D       checks the header against the reservation, then recv()s straight into the
             reserved block; a checked-and-dropped header still has its payload drained
             into scratch, so headers and payloads stay paired in order. On a CPU pool (gloo)
             that recv holds D's loop: a payload that has not come within payload_wait_s
             (--kv-payload-wait-s) fails its transfer and breaks the pair, counted and logged,
             and D's loop serves the other peers (P pairs again); a CUDA pool's recv is queued
             on its stream and holds no loop, but a payload that never comes stalls the next
             step's stream (unbounded here: NCCL's own timeout applies)
  4. a header D cannot read or authenticate breaks the pair (it may be followed by a payload
     D cannot place): the pair's transfers fail (CHANNEL_BROKEN); P must connect() again

DistChannel (send side) and _DistSink (receive side) are the payload strategies; DistSender and
DistReceiver put them on the ZMQ link.
"""
from __future__ import annotations

import datetime
import logging
import queue
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from kvtransport.base import TransportError
from kvtransport.payload import TORCH_DTYPES, WriteBlocks, block_view, check_whole_blocks
from kvtransport.payload_channel import PayloadChannel
from kvtransport.receiver import Receiver
from kvtransport.receiver_core import PayloadSink
from kvtransport.sender import Sender
from kvtransport.zmq_link import DEFAULT_BIND, ZmqReceiveLink
from kvtransport.zmq_send_link import ZmqSendLink
from pdwire.handshake import KVLayout, PeerIdentity
from pdwire.messages import PAYLOAD_WAIT_S, BlockFrame, Message, P2PJoin

log = logging.getLogger("kvtransport")

_RECV_RANK, _SEND_RANK = 0, 1
# The send side's group join, the one step of a pairing that blocks a prefill node's loop
# (kvtransport.sender): the TCPStore connect and the gloo rendezvous share what is left of the
# pairing's timeout, at most this. The node cannot know the router's --heartbeat-timeout-s
# (default 10 s; tests/kvtransport/test_kvtransport_dist.py checks it against this): the
# TCPStore's connect retries past its timeout by up to a retry delay (measured: 3.3 s for a
# 1.5 s timeout to a refused port), so the join may hold the loop about 2 * MAX_JOIN_S, with
# room left for an engine step before the next beat. (NCCL builds its communicator lazily, on
# the first send, bounded by the store's timeout, not by this.)
MAX_JOIN_S = 3.0
_CLOSE_WAIT_S = 0.5     # a dropped pair's send thread: once its sends are done it ends at once
MAX_PENDING_JOINS = 64  # a decode node's group joins under way at once (each ends by its timeout)


def _left(deadline: float) -> datetime.timedelta:
    """The time left to deadline; TransportError if none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError("no time left to join the pair's process group")
    return datetime.timedelta(seconds=left)


def make_pair_group(store: dist.Store, group: str, rank: int, device: torch.device,
                    host: str, timeout: float, join_timeout: float | None = None) -> dist.ProcessGroup:
    """The two-rank group of one pair: NCCL for a CUDA pool, gloo (bound to host) otherwise;
    gloo's rendezvous waits up to join_timeout (default: timeout), its operations timeout s."""
    prefixed = dist.PrefixStore(f"kvtransport/{group}", store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(prefixed, rank, 2)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=timeout if join_timeout is None else join_timeout)
    pg = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    pg._set_default_timeout(datetime.timedelta(seconds=timeout))
    return pg


def _close_group(pg: dist.ProcessGroup) -> None:
    try:
        pg.shutdown()
    except Exception as e:   # backends differ in what shutdown supports
        log.debug("process group shutdown: %s", e)


class _Completion:
    """One tensor send: done once the group has finished with the source tensor."""
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done, self.error = False, None


class _SendWaiter:
    """A thread that waits on a group's sends in order (a gloo Work only completes in wait()), each
    up to timeout s: gloo's own operation timeout is the group's join timeout (what was left of
    the pairing's MAX_JOIN_S), which broke a healthy pair whose decode node was busy for 3 s."""

    def __init__(self, pg: dist.ProcessGroup, timeout: float) -> None:
        self.pg, self._timeout = pg, datetime.timedelta(seconds=timeout)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvtransport-send-wait", daemon=True)
        self._thread.start()

    def send(self, tensor: torch.Tensor) -> _Completion:
        done = _Completion()
        self._queue.put((self.pg.send([tensor], _RECV_RANK, 0), done, tensor))   # alive until sent
        return done

    def close(self) -> None:
        """The thread closes the group once the sends queued before have finished or failed (each
        bounded by the group's timeout: a group must not close under a wait); this waits for that
        up to _CLOSE_WAIT_S, as a process that exits while the thread still works on the group
        aborts, and no longer, as it runs on the node's loop when a decode node is dropped."""
        self._queue.put(None)
        self._thread.join(timeout=_CLOSE_WAIT_S)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done, tensor = item
            try:
                if tensor.is_cuda:   # NCCL's wait() only orders this thread's stream after the send
                    work.wait()
                    torch.cuda.current_stream(tensor.device).synchronize()   # so wait for it
                else:
                    work.wait(self._timeout)
            except Exception as e:   # the pair broke; the sender's poll() reports it
                done.error = e
            done.done = True
        _close_group(self.pg)


class _PairJoin:
    """The receive side's join of one pair's group on a thread of its own: gloo's rendezvous
    waits for the peer to join (up to the timeout), and the decode node's loop must go on
    meanwhile. The thread talks to the node's TCPStore over a connection of its own: a TCPStore
    client runs one operation at a time, so a join hanging on a shared one would hold up the rest."""

    def __init__(self, host: str, port: int, group: str, device: torch.device, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self._lock = threading.Lock()
        self._pg: dist.ProcessGroup | None = None
        self._error: str | None = None
        self._dropped = False
        self._thread = threading.Thread(target=self._run, args=(host, port, group, device, timeout),
                                        name="kvtransport-pair-join", daemon=True)
        self._thread.start()

    def _run(self, host: str, port: int, group: str, device: torch.device, timeout: float) -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=_left(self.deadline))
            pg = make_pair_group(store, group, _RECV_RANK, device, host, timeout,
                                 _left(self.deadline).total_seconds())
        except Exception as e:   # gloo raises RuntimeError subclasses of many kinds
            self._error = str(e)[:200]
            return
        with self._lock:
            if not self._dropped:
                self._pg = pg
                return
        _close_group(pg)

    def pending(self) -> bool:
        return self._thread.is_alive()

    def group(self) -> dist.ProcessGroup:
        """The joined group, waiting for the join at most until its deadline (the peer sends its
        first header once its own join is done, and D's ends with it); TransportError if it failed."""
        self._thread.join(max(0.0, self.deadline - time.monotonic()))
        if self._pg is None:
            raise TransportError(f"the pair's group join failed: {self._error or 'timed out'}")
        return self._pg

    def drop(self) -> None:
        """Close the group, now if joined, else once the join ends (a rendezvous cannot be cut short)."""
        with self._lock:
            self._dropped = True
            pg, self._pg = self._pg, None
        if pg is not None:
            _close_group(pg)


class _DistSink(PayloadSink):
    """Receives payloads over each pair's process group: straight into the pool, or, for a pool
    holding some of the heads (tensor parallelism), into one block of scratch that
    `write_blocks` spreads over the ranks."""
    inline = False

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, host: str, timeout: float,
                 write_blocks: WriteBlocks | None = None, payload_wait_s: float = PAYLOAD_WAIT_S) -> None:
        self._kv_cache, self._host, self._timeout = kv_cache, host, timeout
        self._payload_wait = datetime.timedelta(seconds=payload_wait_s)
        self.payloads_missed = 0    # payloads that did not come within payload_wait_s (gloo)
        self._write_blocks = write_blocks
        sock = socket.create_server((host, 0))
        self.store_port = sock.getsockname()[1]
        self._store = dist.TCPStore(host, self.store_port, is_master=True, wait_for_workers=False,
                                    master_listen_fd=sock.detach(),
                                    timeout=datetime.timedelta(seconds=timeout))
        self._groups: dict[str, _PairJoin] = {}
        self._pairings = 0      # a fresh group name per pairing: no rendezvous reads an older one's keys
        self._scratch = torch.empty(layout.block_nbytes, dtype=torch.uint8, device=kv_cache.device)
        self._scratch_block = self._scratch.view(TORCH_DTYPES[layout.kv_dtype]).view(layout.block_shape)[None]

    def paired(self, peer: str, identity: PeerIdentity, reply: Callable[[Message], None]) -> None:
        """Sends peer its P2PJoin and starts joining the group; returns at once."""
        self.forget(peer)
        if sum(j.pending() for j in self._groups.values()) >= MAX_PENDING_JOINS:
            raise TransportError(f"{MAX_PENDING_JOINS} group joins already under way")
        self._pairings += 1
        group = f"{identity.epoch}/{self._pairings}"
        reply(P2PJoin(group, self._host, self.store_port))
        self._groups[peer] = _PairJoin(self._host, self.store_port, group, self._kv_cache.device,
                                       self._timeout)

    def forget(self, peer: str) -> None:
        join = self._groups.pop(peer, None)
        if join is not None:
            join.drop()

    def write(self, peer: str, frame: BlockFrame, payload: memoryview | None, dst: int) -> None:
        pg = self._groups[peer].group()
        if self._write_blocks is None:
            self._receive(pg, block_view(self._kv_cache, dst), peer, frame)
            return
        self._receive(pg, self._scratch, peer, frame)
        self._write_blocks([dst], self._scratch_block)      # copies before it returns

    def discard(self, peer: str, frame: BlockFrame, payload: memoryview | None) -> bool:
        join = self._groups.get(peer)
        if join is None:
            return True
        if frame.nbytes != self._scratch.numel():
            return False
        self._receive(join.group(), self._scratch, peer, frame)
        return True

    def _receive(self, pg: dist.ProcessGroup, into: torch.Tensor, peer: str, frame: BlockFrame) -> None:
        """frame's payload into `into`. A CUDA recv is queued on the stream; a gloo recv holds the
        loop, at most payload_wait_s: past it gloo closes the pair (no late byte lands in `into`)
        and this raises TransportError, so the core fails the transfer and drops the peer."""
        work = pg.recv([into], _SEND_RANK, 0)
        if into.is_cuda:
            work.wait()
            return
        started = time.monotonic()
        try:
            work.wait(self._payload_wait)
        except Exception as e:   # gloo: a timeout, or the pair broke while waiting
            waited = time.monotonic() - started
            timed_out = waited >= self._payload_wait.total_seconds()
            self.payloads_missed += timed_out
            why = (f"not received within {self._payload_wait.total_seconds():.1f} s" if timed_out
                   else f"pair broke after {waited:.1f} s")
            log.warning("payload of %s block %d from %s %s (%s): transfer dropped, pair broken",
                        frame.xfer_id, frame.index, peer, why, str(e)[:200])
            raise TransportError(f"payload {why}") from e

    def unreadable(self, peer: str) -> bool:
        return peer in self._groups


class DistChannel(PayloadChannel):
    """Ships each block as a tensor send on the pair's process group, after its header."""
    joins = True

    def __init__(self, device: str, host: str, timeout: float) -> None:
        self._device, self._host, self._timeout = torch.device(device), host, timeout
        self._waiters: dict[str, _SendWaiter] = {}
        self._in_flight: list[tuple[str, _Completion]] = []

    def paired(self, endpoint: str, remote: PeerIdentity, join: Message | None, timeout: float) -> None:
        """Joins the group join names: the TCPStore connect and gloo's rendezvous share
        min(timeout, MAX_JOIN_S) (see MAX_JOIN_S)."""
        if type(join) is not P2PJoin:
            raise TransportError(f"{endpoint} sent {type(join).__name__}, expected P2PJoin")
        deadline = time.monotonic() + min(timeout, MAX_JOIN_S)
        store = dist.TCPStore(join.store_host, join.store_port, is_master=False, timeout=_left(deadline))
        pg = make_pair_group(store, join.group, _SEND_RANK, self._device, self._host, self._timeout,
                             _left(deadline).total_seconds())
        self._waiters[endpoint] = _SendWaiter(pg, self._timeout)

    def inline(self, kv_cache: torch.Tensor, src_block_id: int) -> None:
        return None

    def send(self, endpoint: str, kv_cache: torch.Tensor, src_block_id: int) -> _Completion:
        payload = block_view(kv_cache, src_block_id)
        if payload.device != self._device:      # e.g. a tp > 1 node's host copy of gathered heads
            payload = payload.to(self._device)
        done = self._waiters[endpoint].send(payload)
        self._in_flight.append((endpoint, done))
        return done

    def broken(self) -> list[tuple[str, str]]:
        failed = [(e, str(d.error)[:200]) for e, d in self._in_flight if d.error is not None]
        self._in_flight = [(e, d) for e, d in self._in_flight if not d.done]
        return failed

    def unpaired(self, endpoint: str) -> None:
        waiter = self._waiters.pop(endpoint, None)
        if waiter is not None:
            waiter.close()


class DistReceiver(Receiver):
    """A Receiver on a ZMQ ROUTER whose block payloads arrive over per-pair torch.distributed groups."""

    def __init__(self, kv_cache: torch.Tensor, identity: PeerIdentity, secret: bytes,
                 bind: str = DEFAULT_BIND, peer_timeout: float = 10.0, hwm: int = 64,
                 p2p_host: str = "127.0.0.1", write_blocks: WriteBlocks | None = None,
                 payload_wait_s: float = PAYLOAD_WAIT_S) -> None:
        """write_blocks: for a pool that holds some of the heads (TPModelRunner.write_blocks);
        without it payloads land straight in the pool, whose blocks must be wire blocks.
        payload_wait_s: how long the loop waits for a payload after its header (CPU pools)."""
        if identity.transport != "torch_dist":
            raise ValueError("a DistReceiver's identity must have transport='torch_dist'")
        if write_blocks is None:
            check_whole_blocks(kv_cache, identity.layout)
        if not 0 < payload_wait_s < float("inf"):
            raise ValueError(f"payload_wait_s must be > 0 and finite, got {payload_wait_s}")
        self._sink = _DistSink(kv_cache, identity.layout, p2p_host, peer_timeout, write_blocks, payload_wait_s)
        link = ZmqReceiveLink(secret, bind, hwm, identity.layout.block_nbytes)
        super().__init__(kv_cache.shape[0], identity, secret, link, self._sink, peer_timeout)

    @property
    def payloads_missed(self) -> int:
        """Payloads that did not come within payload_wait_s after their header (each failed its
        transfer and broke its pair)."""
        return self._sink.payloads_missed


class DistSender(Sender):
    """A Sender on ZMQ DEALER sockets that ships block payloads as tensor sends on per-pair groups."""

    def __init__(self, identity: PeerIdentity, secret: bytes, hwm: int = 64,
                 send_timeout: float = 10.0, heartbeat_interval: float = 1.0,
                 peer_timeout: float = 10.0, device: str = "cpu",
                 p2p_host: str = "127.0.0.1") -> None:
        if identity.transport != "torch_dist":
            raise ValueError("a DistSender's identity must have transport='torch_dist'")
        link = ZmqSendLink(identity.node_id, secret, hwm, send_timeout)
        channel = DistChannel(device, p2p_host, peer_timeout)
        super().__init__(identity, secret, link, channel, heartbeat_interval, peer_timeout)
