"""The router's index of what every node's prefix cache holds, fed by the nodes' KV events.

Each node publishes the chained hash of every full block its prefix cache stores or evicts
(pdwire.control.KVEvents; node_shell/kv_publisher.py), and a snapshot of all of them when it
(re)registers, so the index is the nodes' own account, not a guess from where the router sent
prompts. Because hashes are chained, a node holds a prompt's first k blocks exactly when it holds
hashes 0..k-1: its overlap is the longest leading run of the prompt's hashes it holds.

Bounded: at most `max_blocks` (node, hash) entries over all nodes. Past the bound the least
recently stored or matched entry goes first (counted in pdserve_router_kv_index_evictions);
an index that lost an entry only underestimates a node's overlap, it never invents one.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from prometheus_client import Counter, Gauge

from pdwire.block_hash import BlockHash


class KVIndex:
    def __init__(self, max_blocks: int):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self._max = max_blocks
        self._lru: OrderedDict[tuple[str, BlockHash], None] = OrderedDict()   # least recent first
        self._of_node: dict[str, set[BlockHash]] = {}
        self.evictions = Counter("pdserve_router_kv_index_evictions", "Entries the router's KV index "
                                 "dropped to stay within --kv-index-max-blocks.", registry=None)
        self.size_gauge = Gauge("pdserve_router_kv_index_blocks", "(node, block hash) entries in the "
                                "router's KV index.", registry=None)
        self.size_gauge.set_function(lambda: len(self._lru))

    def apply(self, node_id: str, stored: Sequence[BlockHash], removed: Sequence[BlockHash],
              reset: bool = False) -> None:
        """One KVEvents message of the node; `reset` first forgets all it said before."""
        if reset:
            self.forget(node_id)
        held = self._of_node.setdefault(node_id, set())
        for h in removed:
            if h in held:
                held.discard(h)
                del self._lru[(node_id, h)]
        for h in reversed(stored):      # a chain's head stays longest: its tail is useless without it
            held.add(h)
            self._lru[(node_id, h)] = None
            self._lru.move_to_end((node_id, h))
        self._bound()

    def forget(self, node_id: str) -> None:
        """Drops every entry of the node (it left, died or restarted: a new epoch)."""
        for h in self._of_node.pop(node_id, ()):
            del self._lru[(node_id, h)]

    def matched_blocks(self, node_id: str, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest leading run of `hashes` the node holds; the run is touched."""
        held = self._of_node.get(node_id)
        n = 0
        while held and n < len(hashes) and hashes[n] in held:
            self._lru.move_to_end((node_id, hashes[n]))
            n += 1
        return n

    def record(self, node_id: str, hashes: Sequence[BlockHash]) -> None:
        """Nothing: the index learns what a node holds from the node itself (PrefixAffinity's
        interface, which guesses it from where prompts were sent)."""

    def size(self, node_id: str | None = None) -> int:
        return len(self._lru) if node_id is None else len(self._of_node.get(node_id, ()))

    def _bound(self) -> None:
        while len(self._lru) > self._max:
            (node_id, h), _ = self._lru.popitem(last=False)
            self._of_node[node_id].discard(h)
            self.evictions.inc()
