"""Cost-based routing across both pools (`--routing cost`): the decode node first, by what its
prefix cache already holds and its load; then where the prompt's uncached tail is computed.

    overlap(D)   = leading prompt blocks D's prefix cache holds (kv_index.py: D's own KV events),
                   at most (prompt tokens - 1) // block_size: the last token is always computed
    uncached(D)  = prompt blocks - overlap(D)                  blocks D must receive or compute
    queued(D)    = uncached blocks of the prompts booked to be prefilled on D itself (local
                   prefills) that D's last heartbeat does not show (registry.py): work queued ahead
                   of this prompt there, which a heartbeat shows only as sequences
    used(D)      = blocks in use by D's last heartbeat and the bookings since (admission.py)
    cost(D)      = uncached(D) + queued(D)                     prefill work: this prompt's and
                                                               the prompts queued ahead of it
                   + decode_load_weight * (used(D) + uncached(D))   D's blocks in use once it
                                                               holds this prompt: the blocks it
                                                               adds are the ones it lacks
    rank         = (has waiting requests, cost, coin)          admission takes the first with room
    load guard   when the busiest node runs more than `balance` = (abs, rel) sequences above the
                 idlest, and more than rel x as many (running + waiting + booked since its last
                 heartbeat), the rank is by that load first: a popular prefix cannot pile every
                 decode onto the nodes that hold it (sgl-router's balance_abs/rel_threshold, 32 and
                 1.5; the simulated colocated balancer, pdplan/sim_affinity.py, has the same)

    prefill on D itself when   prompt tokens - overlap(D) * block_size <= local_prefill_tokens
    else on a prefill node P   (policy.PrefillPolicy over the same index: its queued blocks and
                                the blocks of this prompt it must compute)

Dynamo scores workers the same way (`prefill_load_scale * max(active_prefill + prompt_blocks -
overlap, 0) + decode_blocks`, active_prefill: the uncached tokens of the prompts a worker has yet
to prefill, queued(D) here; decode_blocks: the worker's active blocks with the request's new ones,
its "potential" blocks). Counting the blocks the prompt adds matters where a node holds a document
that running requests use: its used(D) counts the document, and without the blocks another node
would add, that node (lacking it) looked as cheap as the holder after one question and prefills locally when the uncached part is short ("conditional
disaggregation"); llm-d picks the decode node first and sends work to a prefill node only past a
threshold of uncached tokens. A local prefill skips the prefill hop (a round trip, a transfer
setup, a queue on P) and ships nothing.
"""
from __future__ import annotations

import random
from typing import Sequence

from pdwire.block_hash import BlockHash
from router.backend import NoNodeAvailable
from router.cluster.kv_index import KVIndex
from router.cluster.policy import DecodePolicy
from router.cluster.registry import Node
from router.config import RouterConfig

BALANCE = (RouterConfig.decode_balance_abs, RouterConfig.decode_balance_rel)


class RoutingCost:
    def __init__(self, index: KVIndex, decode: DecodePolicy, decode_load_weight: float = 1.0,
                 local_prefill_tokens: int = 0, seed: int = 0,
                 balance: tuple[int, float] | None = BALANCE):
        if decode_load_weight < 0 or local_prefill_tokens < 0:
            raise ValueError("decode_load_weight and local_prefill_tokens must be >= 0")
        self._index, self._decode = index, decode
        self._weight, self._local_tokens = decode_load_weight, local_prefill_tokens
        self._balance = balance
        self._rng = random.Random(seed)

    def rank(self, nodes: Sequence[Node], hashes: Sequence[BlockHash], prompt_len: int,
             block_size: int) -> list[Node]:
        """Decode nodes, cheapest first. Raises NoNodeAvailable if `nodes` is empty."""
        if not nodes:
            raise NoNodeAvailable("no live decode node")
        usable = _usable(hashes, prompt_len, block_size)
        guard = imbalanced([sequences(n) for n in nodes], self._balance)
        keyed = [((sequences(n) if guard else 0,) + self._key(n, usable, -(-prompt_len // block_size)), n)
                 for n in nodes]
        return [n for _, n in sorted(keyed, key=lambda kn: kn[0])]

    def _key(self, node: Node, usable: Sequence[BlockHash], prompt_blocks: int) -> tuple:
        uncached = prompt_blocks - self._index.matched_blocks(node.node_id, usable)
        queued = node.unreported_prefill_blocks
        load = self._weight * (self.used_blocks(node) + uncached)
        return node.load.num_waiting > 0, uncached + queued + load, self._rng.random()

    def used_blocks(self, node: Node) -> int:
        return self._decode.num_blocks(node) - self._decode.free_blocks(node)

    def overlap(self, node: Node, hashes: Sequence[BlockHash], prompt_len: int, block_size: int) -> int:
        """overlap(D): the leading prompt blocks the node's prefix cache holds, by the KV index."""
        return self._index.matched_blocks(node.node_id, _usable(hashes, prompt_len, block_size))

    def prefill_here(self, node: Node, hashes: Sequence[BlockHash], prompt_len: int, block_size: int) -> bool:
        """Whether the decode node computes the prompt's uncached tail itself."""
        return prompt_len - self.overlap(node, hashes, prompt_len, block_size) * block_size <= self._local_tokens


def sequences(node: Node) -> int:
    """The node's sequences now: running and waiting by its last heartbeat, and those booked since."""
    return node.load.num_running + node.load.num_waiting + node.unreported_requests


def imbalanced(loads: Sequence[int], balance: tuple[int, float] | None) -> bool:
    """Whether the busiest load is more than abs above, and rel times, the idlest (sgl-router's test)."""
    if balance is None or not loads:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > balance[0] and hi > balance[1] * lo


def _usable(hashes: Sequence[BlockHash], prompt_len: int, block_size: int) -> Sequence[BlockHash]:
    """The hashes a node's cache can serve: the prompt's last token is always computed."""
    return hashes[:(prompt_len - 1) // block_size]
