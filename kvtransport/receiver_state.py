"""The receive side's bookkeeping: reservations, frame checks, leases, exactly-once outcomes.

Backend-free: a backend decodes frames and calls `check_block` / `check_batch` (a BlockBatch or
a LayerBatch) -> (writes the payloads into the returned blocks) -> `mark_written`, `on_commit`,
`on_abort`, `renew`, `fail_peer`, `expire`. A block shipped in layer groups (LayerBatch) arrives once every one
of its layers has; until then it is still missing, and a whole-block frame for it is a duplicate.
Every registered transfer ends in exactly one event from `take_events()`. Frames are checked
against the layout this node announced at handshake (a block with every kv head), not against
the pool tensor: on a tensor-parallel node the pool holds only rank 0's heads.

    dst_block_ids:   [ b0 | b1 | b2 | b3 | b4 ]        the prompt's block table in D's pool
                       └cached┘ └─ shipped ──────┘      index >= cached_prefix_blocks
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvtransport.events import FailReason, TransferCommitted, TransferEvent, TransferFailed
from kvtransport.framing import FrameError
from pdwire.handshake import KVLayout
from pdwire.messages import Abort, BlockBatch, BlockFrame, Commit, LayerBatch, Reserved
from kvtransport.metrics import DropReason, ReceiverMetrics
from pdwire.schema import MAX_BLOCKS, check_id
from kvtransport.state import TransferState

_MAX_TOMBSTONES = 1 << 16   # finished xfer ids remembered, to tell "late" from "unknown"


@dataclass(frozen=True, slots=True)
class Reservation:
    """Blocks D reserved for one transfer; P ships dst_block_ids[cached_prefix_blocks:]."""
    xfer_id: str
    dst_block_ids: tuple[int, ...]   # the prompt's whole block table in D's pool
    cached_prefix_blocks: int = 0    # leading blocks D already holds: not expected on the wire
    lease_s: float = 30.0            # renewed by every frame and every heartbeat naming it
    sender_node_id: str | None = None  # only this prefill node may write it (None: first claimer)
    num_tokens: int | None = None    # the Commit must carry exactly this many (None: any that fit)

    def __post_init__(self) -> None:
        check_id(self.xfer_id, "xfer_id")
        if self.sender_node_id is not None:
            check_id(self.sender_node_id, "sender_node_id")
        object.__setattr__(self, "dst_block_ids", tuple(int(b) for b in self.dst_block_ids))
        if not 0 < len(self.dst_block_ids) <= MAX_BLOCKS:
            raise ValueError(f"a reservation needs 1..{MAX_BLOCKS} blocks")
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise ValueError("dst_block_ids repeats a block")
        if not 0 <= self.cached_prefix_blocks <= len(self.dst_block_ids):
            raise ValueError("cached_prefix_blocks outside [0, len(dst_block_ids)]")
        if not self.lease_s > 0:
            raise ValueError("lease_s must be > 0")
        if self.num_tokens is not None and not 0 < self.num_tokens <= len(self.dst_block_ids) * (1 << 16):
            raise ValueError("num_tokens must be > 0 and fit the blocks")

    @classmethod
    def from_reserved(cls, msg: Reserved, lease_s: float = 30.0,
                      sender_node_id: str | None = None) -> Reservation:
        return cls(msg.xfer_id, msg.dst_block_ids, msg.cached_prefix_blocks, lease_s, sender_node_id)

    @property
    def expected(self) -> range:
        """Indices of the blocks that must arrive over the wire."""
        return range(self.cached_prefix_blocks, len(self.dst_block_ids))


@dataclass(slots=True)
class _Inbound:
    res: Reservation
    registered_at: float
    deadline: float
    missing: set[int]                        # indices still expected
    state: TransferState = TransferState.RESERVED
    peer: str | None = None                  # claimed by the first peer that names it
    commit: Commit | None = None
    first_frame_at: float | None = None
    nbytes: int = 0
    layers: dict[int, int] = field(default_factory=dict)   # index -> bit l: layer l arrived (partial blocks)


class ReceiveLedger:
    """All live reservations of one pool. Not thread-safe; the backend's poll thread owns it."""

    def __init__(self, layout: KVLayout, num_blocks: int, metrics: ReceiverMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout                        # what every block frame must be
        self.num_blocks = num_blocks                # of the pool: block ids are in [0, num_blocks)
        self.metrics = metrics or ReceiverMetrics()
        self.clock = clock
        self.block_nbytes = layout.block_nbytes
        self._block_shape = layout.block_shape      # a property that builds its tuple each call
        self._all_layers = (1 << layout.num_layers) - 1
        self._live: dict[str, _Inbound] = {}
        self._reserved_blocks: set[int] = set()     # shipped blocks of live transfers
        self._finished: OrderedDict[str, TransferState] = OrderedDict()   # tombstones
        self._node_of: dict[str, str] = {}          # paired peer -> its node_id
        self._events: list[TransferEvent] = []

    def register(self, res: Reservation) -> None:
        """Start expecting res's blocks; raises ValueError for a reused id or a block already held."""
        if res.xfer_id in self._live or res.xfer_id in self._finished:
            raise ValueError(f"xfer id {res.xfer_id} already used")
        bad = [b for b in res.dst_block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside the pool")
        shipped = {res.dst_block_ids[i] for i in res.expected}
        if shipped & self._reserved_blocks:
            raise ValueError(f"blocks {sorted(shipped & self._reserved_blocks)} already reserved")
        now = self.clock()
        self._live[res.xfer_id] = _Inbound(res, now, now + res.lease_s, set(res.expected))
        self._reserved_blocks |= shipped

    def pair(self, peer: str, node_id: str | None) -> None:
        """peer is the prefill node node_id (None: peer is gone)."""
        if node_id is None:
            self._node_of.pop(peer, None)
        else:
            self._node_of[peer] = node_id

    def live_xfers(self, peer: str | None = None) -> list[str]:
        return [x for x, t in self._live.items() if peer is None or t.peer == peer]

    def holds(self, peer: str, xfer_id: str) -> bool:
        """xfer_id is live and claimed by peer."""
        t = self._live.get(xfer_id)
        return t is not None and t.peer == peer

    def claim(self, peer: str, xfer_id: str) -> None:
        """peer (which may touch it: checked) makes progress on live xfer_id: it is peer's now."""
        self._progress(self._live[xfer_id], peer)

    def state(self, xfer_id: str) -> TransferState | None:
        t = self._live.get(xfer_id)
        return t.state if t is not None else self._finished.get(xfer_id)

    def check_block(self, peer: str, frame: BlockFrame, payload_len: int | None) -> int:
        """The pool block to write frame's payload into; raises FrameError if it must be dropped.
        Changes nothing (mark_written records the write).

        payload_len is the received payload's length (None when the payload arrives out of band).
        """
        t = self._lookup(peer, frame.xfer_id)
        self._check_slot(t, frame.index, frame.block_id)
        self._check_layout(frame.dtype, frame.shape, frame.nbytes)
        if payload_len not in (None, frame.nbytes):
            raise FrameError(DropReason.BAD_NBYTES, f"{frame.nbytes} / {payload_len}")
        return frame.block_id

    def check_batch(self, peer: str, batch: BlockBatch | LayerBatch, payload_lens: list[int]) -> None:
        """Raises FrameError unless every block of batch may be written into its block_ids (a
        LayerBatch: layers [first_layer, first_layer + shape[0]) of each, none of them arrived
        yet), from payload frames of payload_lens bytes; the batch is then dropped whole."""
        t = self._lookup(peer, batch.xfer_id)
        if type(batch) is BlockBatch:
            self._check_layout(batch.dtype, batch.shape, batch.nbytes)
            want = self._all_layers
        else:
            want = self._check_slice(batch)
        if not self._slots_free(t, batch.indices, batch.block_ids, want):
            for index, block_id in zip(batch.indices, batch.block_ids):
                self._check_slot(t, index, block_id, want)      # raises, naming the first bad block
        if payload_lens != [batch.nbytes] * len(batch.indices):
            raise FrameError(DropReason.BAD_NBYTES, f"{len(batch.indices)} x {batch.nbytes} / {payload_lens}")

    def mark_written(self, peer: str, frame: BlockFrame | BlockBatch | LayerBatch, write_seconds: float = 0.0) -> None:
        """frame's payloads from peer are in the pool (after a successful check_block / check_batch,
        which change nothing): peer claims the transfer, its lease is renewed."""
        t = self._live[frame.xfer_id]
        self._progress(t, peer)
        indices = (frame.index,) if type(frame) is BlockFrame else frame.indices
        if type(frame) is LayerBatch:
            indices = self._add_layers(t, frame)
        t.missing.difference_update(indices)
        nbytes = frame.nbytes * (len(frame.indices) if type(frame) is LayerBatch else len(indices))
        t.nbytes += nbytes
        self.metrics.blocks_written += len(indices)
        self.metrics.bytes_written += nbytes
        self.metrics.write_seconds += write_seconds
        self._maybe_complete(t)

    def _add_layers(self, t: _Inbound, batch: LayerBatch) -> list[int]:
        """Note batch's layers of each of its blocks; returns the blocks it completed."""
        want, done = ((1 << batch.shape[0]) - 1) << batch.first_layer, []
        for index in batch.indices:
            t.layers[index] = t.layers.get(index, 0) | want
            if t.layers[index] == self._all_layers:
                del t.layers[index]
                done.append(index)
        return done

    def on_commit(self, peer: str, msg: Commit) -> None:
        t = self._lookup(peer, msg.xfer_id)
        if t.commit is not None:
            raise FrameError(DropReason.DUPLICATE, "second commit")
        n = len(t.res.dst_block_ids)
        block_size = self.layout.block_size
        if not (n - 1) * block_size < msg.num_tokens <= n * block_size or \
                t.res.num_tokens not in (None, msg.num_tokens):
            raise FrameError(DropReason.BAD_COMMIT, f"{msg.num_tokens} tokens in {n} blocks")
        self._progress(t, peer)
        t.commit = msg
        self._maybe_complete(t)

    def on_abort(self, peer: str, msg: Abort) -> None:
        t = self._lookup(peer, msg.xfer_id)
        t.peer = peer
        self._fail(t, FailReason.PEER_ABORTED, msg.reason)

    def renew(self, peer: str, xfer_ids: tuple[str, ...]) -> None:
        """A heartbeat from peer naming the transfers it holds: claim and renew each live one."""
        for xfer_id in xfer_ids:
            t = self._live.get(xfer_id)
            if t is not None and self._may_touch(peer, t):
                t.peer = peer
                t.deadline = self.clock() + t.res.lease_s

    def abort(self, xfer_id: str, reason: FailReason, detail: str = "") -> str | None:
        """Fail a live transfer; returns the peer holding it (to notify), None if none or not live."""
        t = self._live.get(xfer_id)
        if t is None:
            return None
        self._fail(t, reason, detail)
        return t.peer

    def fail_peer(self, peer: str, reason: FailReason, detail: str = "") -> None:
        for xfer_id in self.live_xfers(peer):
            self._fail(self._live[xfer_id], reason, detail)

    def expire(self) -> list[tuple[str, str | None]]:
        """Fail every transfer whose lease ran out; returns (xfer_id, peer) of each."""
        now = self.clock()
        expired = [t for t in self._live.values() if t.deadline <= now]
        for t in expired:
            self._fail(t, FailReason.LEASE_EXPIRED, f"no progress for {t.res.lease_s}s")
        return [(t.res.xfer_id, t.peer) for t in expired]

    def take_events(self) -> list[TransferEvent]:
        events, self._events = self._events, []
        return events

    def _lookup(self, peer: str, xfer_id: str) -> _Inbound:
        """The live transfer xfer_id if peer may touch it (it is unclaimed or peer's)."""
        t = self._live.get(xfer_id)
        if t is None:
            late = xfer_id in self._finished
            raise FrameError(DropReason.FINISHED_XFER if late else DropReason.UNKNOWN_XFER, xfer_id)
        if not self._may_touch(peer, t):
            raise FrameError(DropReason.WRONG_PEER, xfer_id)
        return t

    def _check_slot(self, t: _Inbound, index: int, block_id: int, layers: int | None = None) -> None:
        """Block `index` of t goes to block_id, and none of `layers` (a bit per layer; None: all of
        them) has arrived yet."""
        res = t.res
        if index not in res.expected or res.dst_block_ids[index] != block_id:
            raise FrameError(DropReason.NOT_RESERVED, f"index {index} block {block_id}")
        if index not in t.missing or t.layers.get(index, 0) & (self._all_layers if layers is None else layers):
            raise FrameError(DropReason.DUPLICATE, f"index {index}")

    @staticmethod
    def _slots_free(t: _Inbound, indices: tuple[int, ...], block_ids: tuple[int, ...], layers: int) -> bool:
        """_check_slot for every block of a batch at once, in C-level set and tuple operations (no
        Python step a block); False when any fails, for _check_slot to name it. t.missing holds
        indices of t.res.expected only (it starts as them and only shrinks), so an index it holds
        is expected and names a block of dst_block_ids."""
        return t.missing.issuperset(indices) and tuple(map(t.res.dst_block_ids.__getitem__, indices)) == block_ids \
            and not (t.layers and any(t.layers.get(i, 0) & layers for i in indices))

    def _check_layout(self, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
        """A block of dtype, shape and nbytes is one of this node's wire blocks."""
        if dtype != self.layout.kv_dtype:
            raise FrameError(DropReason.BAD_DTYPE, dtype)
        if shape != self._block_shape:
            raise FrameError(DropReason.BAD_SHAPE, str(shape))
        if nbytes != self.block_nbytes:
            raise FrameError(DropReason.BAD_NBYTES, f"{nbytes}")

    def _check_slice(self, batch: LayerBatch) -> int:
        """batch's slices are layers of this node's wire blocks; returns them, a bit per layer."""
        layout, (first, count) = self.layout, (batch.first_layer, batch.shape[0] if batch.shape else 0)
        if batch.dtype != layout.kv_dtype:
            raise FrameError(DropReason.BAD_DTYPE, batch.dtype)
        if batch.shape[1:] != layout.block_shape[1:] or not 0 < count <= layout.num_layers - first:
            raise FrameError(DropReason.BAD_SHAPE, f"layers {first}+{batch.shape}")
        if batch.nbytes != self.block_nbytes // layout.num_layers * count:
            raise FrameError(DropReason.BAD_NBYTES, f"{batch.nbytes}")
        return ((1 << count) - 1) << first

    def _may_touch(self, peer: str, t: _Inbound) -> bool:
        node = t.res.sender_node_id
        return t.peer in (None, peer) and (node is None or self._node_of.get(peer) == node)

    def _progress(self, t: _Inbound, peer: str) -> None:
        """A valid frame from peer: claim the transfer for peer and renew its lease."""
        now = self.clock()
        t.peer = peer
        t.deadline = now + t.res.lease_s
        if t.state is TransferState.RESERVED:
            t.state = t.state.advance(TransferState.TRANSFERRING)
            t.first_frame_at = now

    def _maybe_complete(self, t: _Inbound) -> None:
        if t.missing or t.commit is None:
            return
        now = self.clock()
        t.state = t.state.advance(TransferState.COMMITTED)
        self._finish(t)
        self.metrics.transfers_committed += 1
        self._events.append(TransferCommitted(
            t.res.xfer_id, t.commit.first_token, t.commit.num_tokens, t.res.dst_block_ids,
            t.nbytes, t.first_frame_at - t.registered_at, now - t.first_frame_at))

    def _fail(self, t: _Inbound, reason: FailReason, detail: str) -> None:
        t.state = t.state.advance(TransferState.FAILED)
        self._finish(t)
        self.metrics.transfers_failed += 1
        self._events.append(TransferFailed(t.res.xfer_id, reason, detail))

    def _finish(self, t: _Inbound) -> None:
        del self._live[t.res.xfer_id]
        self._reserved_blocks -= {t.res.dst_block_ids[i] for i in t.res.expected}
        self._finished[t.res.xfer_id] = t.state
        if len(self._finished) > _MAX_TOMBSTONES:
            self._finished.popitem(last=False)
