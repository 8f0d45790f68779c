"""What a node's prefix cache stored and evicted since the router last heard: the KV events.

The block manager reports each full block's chained hash when it enters the prefix cache
(`commit_computed`) and when it leaves it (eviction); a node drains the log into KVEvents
messages (node_shell/kv_publisher.py) so the router's index (router/cluster/kv_index.py) holds
exactly what each node holds. The log is bounded: past `max_pending` hashes it drops them and
asks for a snapshot instead, which the node sends as it does on (re)registration.
"""
from __future__ import annotations

from typing import NamedTuple

from pdwire.block_hash import BlockHash

DEFAULT_MAX_PENDING = 1 << 16


class KVEventBatch(NamedTuple):
    stored: list[BlockHash]     # in the cache now
    removed: list[BlockHash]    # not in the cache now
    overflowed: bool            # hashes were dropped since the last drain: send a snapshot


class KVEventLog:
    """Coalesced: a hash noted twice keeps its last state, so a batch lists each hash once, as
    stored or as removed, and applying it in any order leaves the router's index exact."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._max = max_pending
        self._last: dict[BlockHash, bool] = {}      # hash -> in the cache now
        self._overflowed = False

    def stored(self, block_hash: BlockHash) -> None:
        self._note(block_hash, True)

    def removed(self, block_hash: BlockHash) -> None:
        self._note(block_hash, False)

    def _note(self, block_hash: BlockHash, present: bool) -> None:
        if self._overflowed:
            return
        if len(self._last) >= self._max and block_hash not in self._last:
            self._last, self._overflowed = {}, True
            return
        self._last[block_hash] = present

    @property
    def pending(self) -> bool:
        return bool(self._last) or self._overflowed

    def drain(self) -> KVEventBatch:
        """Everything noted since the last drain; the log starts empty again."""
        batch = KVEventBatch([h for h, p in self._last.items() if p], [h for h, p in self._last.items() if not p],
                             self._overflowed)
        self._last, self._overflowed = {}, False
        return batch
