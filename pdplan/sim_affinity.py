"""The router's view of where to prefill, as router/cluster/policy.py and registry.py keep it:

  - affinity: per node, the chained block hashes the router has sent there (an LRU of
    `capacity` hashes, router config affinity_blocks_per_node), recorded the moment a node is
    chosen, so a second request for a document still being prefilled follows the first
  - bookings: per node, the blocks of work chosen for it and not yet done (its uncached blocks),
    released when its first token is out

    cost(node) = booked blocks + this prompt's blocks the node lacks; ties: fewer requests booked,
                 then fewer sequences running or waiting there (the router's heartbeat figure)

The simulated prefill pool and the colocated balancer both choose with it, so each sees the hits
the real router would price. Colocated replicas also decode what they prefill, so their balancer
adds SGLang's cache-aware router's guard (sgl-router: balance_abs_threshold 32,
balance_rel_threshold 1.5): when the busiest replica runs more than 32 sequences above, and 1.5x,
the idlest, the request goes to the idlest whatever it has cached, so a popular document does not
pile its decodes onto one replica.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from router.cluster.routing_cost import BALANCE, imbalanced
from router.config import RouterConfig

AFFINITY_BLOCKS = RouterConfig.affinity_blocks_per_node     # the real router's default


class PrefixAffinity:
    def __init__(self, count: int, load: Callable[[int], int], capacity: int = AFFINITY_BLOCKS,
                 balance: bool = False):
        """load(node): its sequences running or waiting. balance: the colocated guard above."""
        self.capacity, self.load, self.balance = capacity, load, balance
        self.sent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(count)]
        self.booked_blocks = [0] * count
        self.booked_requests = [0] * count

    def matched(self, node: int, hashes: tuple[int, ...]) -> int:
        """The leading run of `hashes` sent to `node` (chained: holding block k means 0..k-1)."""
        sent, lo, hi = self.sent[node], 0, len(hashes)
        while lo < hi:                  # the run is a prefix: find its end by bisection
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if hashes[mid - 1] in sent else (lo, mid - 1)
        return lo

    def choose(self, hashes: tuple[int, ...], num_blocks: int) -> tuple[int, int]:
        """The cheapest node and the blocks it must compute; books them and records the hashes."""
        loads = [self.load(i) for i in range(len(self.sent))]
        if self.balance and imbalanced(loads, BALANCE):
            node = loads.index(min(loads))
        else:
            node = min((self.booked_blocks[i] + num_blocks - self.matched(i, hashes), self.booked_requests[i], loads[i], i)
                       for i in range(len(self.sent)))[-1]
        new_blocks = num_blocks - self.matched(node, hashes)
        self.booked_blocks[node] += new_blocks
        self.booked_requests[node] += 1
        self._record(node, hashes)
        return node, new_blocks

    def release(self, node: int, new_blocks: int) -> None:
        self.booked_blocks[node] -= new_blocks
        self.booked_requests[node] -= 1

    def _record(self, node: int, hashes: tuple[int, ...]) -> None:
        sent = self.sent[node]
        for h in reversed(hashes):      # leading blocks newest: a chain is evicted from its tail
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity:
            sent.popitem(last=False)
