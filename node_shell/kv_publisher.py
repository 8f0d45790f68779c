"""A node's KV events to the router: the block hashes its prefix cache stored and evicted.

    every loop iteration: flush()
      1. a hello went out since the last flush (a new epoch, or the router asked this node to
         register again): a snapshot, every hash cached now, the first message with `reset`
      2. else, at most every FLUSH_S, what the log gathered: one KVEvents (the log is coalesced
         and bounded; if it overflowed, a snapshot instead)
Sends never block (RouterLink.send); with no session up nothing is sent and the next hello
brings a snapshot, so the router's index never misses what happened in between.
"""
from __future__ import annotations

import time

from engine.block_manager import BlockManager
from engine.kv_events import KVEventLog
from node_shell.router_link import RouterLink
from pdwire.block_hash import BlockHash
from pdwire.control import MAX_KV_EVENT_HASHES, KVEvents

FLUSH_S = 0.02      # batches KV events over this long: the router's index lags at most ~this


class KVPublisher:
    def __init__(self, block_manager: BlockManager, node_id: str, link: RouterLink):
        self._bm, self._node_id, self._link = block_manager, node_id, link
        self.log = block_manager.events = KVEventLog()
        self._hellos = -1           # link.hellos at the last snapshot
        self._sent_at = 0.0
        self.messages = 0           # KVEvents sent, snapshots included

    def flush(self) -> None:
        if not self._link.connected:
            return
        if self._link.hellos != self._hellos:
            return self._snapshot()
        now = time.monotonic()
        if not self.log.pending or now - self._sent_at < FLUSH_S:
            return
        batch = self.log.drain()
        if batch.overflowed:
            return self._snapshot()
        self._sent_at = now
        for lo in range(0, max(len(batch.stored), len(batch.removed)), MAX_KV_EVENT_HASHES):
            self._send(batch.stored[lo:lo + MAX_KV_EVENT_HASHES], batch.removed[lo:lo + MAX_KV_EVENT_HASHES])

    def _snapshot(self) -> None:
        self._hellos = self._link.hellos
        self.log.drain()                # the snapshot holds all of it
        self._sent_at = time.monotonic()
        hashes = self._bm.cached_hashes()
        for lo in range(0, max(1, len(hashes)), MAX_KV_EVENT_HASHES):
            self._send(hashes[lo:lo + MAX_KV_EVENT_HASHES], [], reset=lo == 0)

    def _send(self, stored: list[BlockHash], removed: list[BlockHash], reset: bool = False) -> None:
        self._link.send(KVEvents(self._node_id, self._link.epoch, tuple(stored), tuple(removed), reset))
        self.messages += 1
