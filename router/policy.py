"""Where a request goes: a prefill node by prefix-cache affinity against load, a decode node by KV usage.

Prefill: the router remembers, per prefill node, the chained block hashes it recently sent there
(a bounded LRU). Because hashes are chained, a node holds a prompt's first k blocks exactly when
it holds the hash of block k-1, so a node's hit is the longest leading run of the prompt's hashes
it holds. The chosen node is the one that finishes soonest by a simple estimate, in blocks:

    cost(node) = load_weight * blocks already in flight there + blocks of this prompt it must compute

Decode: power of two choices: two distinct nodes drawn with a seeded RNG, the one with the lower
KV usage wins (then fewer requests in flight, then node id).
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import NamedTuple, Sequence

from router.registry import Node


class NoNodeAvailable(RuntimeError):
    """No live node of the needed role: the router answers 503."""


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


class PrefillPolicy:
    def __init__(self, affinity: PrefixAffinity, load_weight: float = 1.0):
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


class DecodePolicy:
    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def choose(self, nodes: Sequence[Node]) -> Node:
        """Power of two choices by KV usage. Raises NoNodeAvailable if `nodes` is empty."""
        if not nodes:
            raise NoNodeAvailable("no decode node available")
        if len(nodes) == 1:
            return nodes[0]
        pair = self._rng.sample(list(nodes), 2)
        return min(pair, key=lambda n: (n.load.kv_usage, n.inflight_requests, n.node_id))
