"""Where a request goes: a prefill node by prefix-cache affinity against load, a decode node by KV usage.

Prefill: the router remembers, per prefill node, the chained block hashes it recently sent there
(a bounded LRU). Because hashes are chained, a node holds a prompt's first k blocks exactly when
it holds the hash of block k-1, so a node's hit is the longest leading run of the prompt's hashes
it holds. The chosen node is the one that finishes soonest by a simple estimate, in blocks:

    cost(node) = load_weight * blocks already in flight there + blocks of this prompt it must compute

Decode: the least-loaded node with room, by the node's last heartbeat plus the router's bookings
since (registry.py): a request is booked on its node the moment it is chosen, so a burst that
arrives between two heartbeats spreads instead of landing on the node that looked emptiest.

    free(node)  = free blocks at its last heartbeat (its hello: all) - node.unreported_blocks
    room        = free(node) >= blocks the request needs (prompt + growth), or it can never fit
    rank        = (has waiting requests, 1 - free / num_blocks, running + waiting + unreported, coin)

A node with waiting requests already runs all it can (max_num_seqs, which is not on the wire, or
its blocks): it goes last. Ties are broken by a seeded coin, not by node id.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Callable, NamedTuple, Protocol, Sequence

from router.backend import NoNodeAvailable  # noqa: F401 -- raised here, defined with the interface
from router.cluster.registry import Node


class PrefixAffinity:
    """Per node, an LRU of block hashes; eviction drops a prompt's tail blocks first.

    record() touches a prompt's hashes from last to first, so its first block is the most recent
    and its tail is evicted first, as the nodes' own prefix caches do: a chained hash is useless
    once an earlier block of its chain is gone.
    """

    def __init__(self, capacity_per_node: int):
        if capacity_per_node < 1:
            raise ValueError(f"capacity_per_node must be >= 1, got {capacity_per_node}")
        self._capacity = capacity_per_node
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, node_id: str, hashes: Sequence[bytes]) -> None:
        lru = self._lru.setdefault(node_id, OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self._capacity:
            lru.popitem(last=False)

    def matched_blocks(self, node_id: str, hashes: Sequence[bytes]) -> int:
        """Length of the longest leading run of `hashes` recently sent to the node."""
        lru = self._lru.get(node_id, {})
        n = 0
        while n < len(hashes) and hashes[n] in lru:
            n += 1
        return n

    def forget(self, node_id: str) -> None:
        """Drops everything known about a node (it left, died or restarted)."""
        self._lru.pop(node_id, None)

    def size(self, node_id: str) -> int:
        return len(self._lru.get(node_id, ()))


class PrefillChoice(NamedTuple):
    node: Node
    matched_blocks: int     # leading blocks the node is believed to hold already
    new_blocks: int         # blocks it must compute: the work begin() should count


class PrefixView(Protocol):
    """What the prefill policy knows of the nodes' prefix caches: PrefixAffinity (a guess from
    where prompts went) or the KV index (router/cluster/kv_index.py: the nodes' own events)."""

    def matched_blocks(self, node_id: str, hashes: Sequence[bytes]) -> int: ...

    def record(self, node_id: str, hashes: Sequence[bytes]) -> None: ...


class PrefillPolicy:
    def __init__(self, affinity: PrefixView, load_weight: float = 1.0):
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self._affinity = affinity
        self._load_weight = load_weight

    def choose(self, nodes: Sequence[Node], hashes: Sequence[bytes], num_blocks: int) -> PrefillChoice:
        """Picks the cheapest node for a prompt of `num_blocks` blocks whose full blocks hash to
        `hashes`, and records the hashes as sent there. Raises NoNodeAvailable if `nodes` is empty."""
        if not nodes:
            raise NoNodeAvailable("no prefill node available")
        choices = [self._price(n, hashes, num_blocks) for n in nodes]
        cost, _, _, _, best = min(choices, key=lambda c: c[:4])
        matched = self._affinity.matched_blocks(best.node_id, hashes)
        self._affinity.record(best.node_id, hashes)
        return PrefillChoice(best, matched, num_blocks - matched)

    def _price(self, node: Node, hashes: Sequence[bytes], num_blocks: int) -> tuple:
        new_blocks = num_blocks - self._affinity.matched_blocks(node.node_id, hashes)
        cost = self._load_weight * node.inflight_blocks + new_blocks
        queued = node.load.num_running + node.load.num_waiting
        return cost, node.inflight_requests, queued, node.node_id, node


class Pool(NamedTuple):
    """A decode node's KV pool as it last reported it."""
    num_blocks: int
    free_blocks: int


class DecodePolicy:
    def __init__(self, pool: Callable[[Node], Pool], seed: int = 0):
        self._pool = pool
        self._rng = random.Random(seed)

    def rank(self, nodes: Sequence[Node]) -> list[Node]:
        """`nodes`, least loaded first. Raises NoNodeAvailable if `nodes` is empty."""
        if not nodes:
            raise NoNodeAvailable("no live decode node")
        return sorted(nodes, key=self._load)

    def free_blocks(self, node: Node) -> int:
        """Blocks free on the node now, by its last heartbeat and the router's bookings since."""
        return self._pool(node).free_blocks - node.unreported_blocks

    def num_blocks(self, node: Node) -> int:
        return self._pool(node).num_blocks

    def has_room(self, node: Node, blocks: int) -> bool:
        """Whether a request needing `blocks` blocks fits, or could never fit (the node refuses it)."""
        return blocks > self._pool(node).num_blocks or self.free_blocks(node) >= blocks

    def _load(self, node: Node) -> tuple:
        seqs = node.load.num_running + node.load.num_waiting + node.unreported_requests
        used = 1.0 - self.free_blocks(node) / max(1, self._pool(node).num_blocks)
        return node.load.num_waiting > 0, used, seqs, self._rng.random()
