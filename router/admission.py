"""Steps 1-3 of an attempt in disaggregated mode (see router/disaggregated.py): pick a decode node
D and a prefill node P, get D's reservation (trying other decode nodes, or waiting, while they
answer Busy), and send P its PrefillRequest into that reservation."""
from __future__ import annotations

import asyncio
from typing import Callable

from prometheus_client import Counter

from engine.block_hash import chain_hashes
from kvtransport.control import DecodeRequest, PrefillRequest, RequestFailed
from kvtransport.messages import Busy, Reserved
from router.config import RouterConfig
from router.control_server import ControlServer
from router.disagg_request import Attempt, Choice, Failure, Lost
from router.policy import DecodePolicy, NoNodeAvailable, PrefillChoice, PrefillPolicy, PrefixAffinity
from router.registry import Node, NodeRegistry, NodeRole

_POLL_S = 0.05              # how often a failed-over request looks for a live node
_MIN_BUSY_WAIT_S = 0.01     # least wait after every decode node said Busy


class Admission:
    """The DisaggregatedBackend's admission of one attempt at a time; it counts Busy replies and
    books each node's blocks in the registry as the attempt reaches it (`Attempt.begun`)."""

    def __init__(self, config: RouterConfig, registry: NodeRegistry, server: ControlServer,
                 affinity: PrefixAffinity, is_healthy: Callable[[], bool]):
        self._config, self._registry, self._server, self._is_healthy = config, registry, server, is_healthy
        self._prefill_policy = PrefillPolicy(affinity, config.prefill_load_weight)
        self._decode_policy = DecodePolicy(config.policy_seed)
        self.busy = Counter("pdserve_router_busy_replies", "Busy replies from decode nodes.", registry=None)

    async def admit(self, choice: Choice, att: Attempt) -> Failure | None:
        """Picks P and D and gets D's reservation. Raises NoNodeAvailable when that cannot happen."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.admission_timeout_s
        busy: dict[str, float] = {}     # decode nodes that said Busy this round: retry_after in s
        while True:
            await self._wait_for_nodes(choice, deadline)
            decode = self._choose_decode(choice, busy)
            if decode is None:          # every decode node is busy: wait, then ask them again
                await asyncio.sleep(min(max(min(busy.values()), _MIN_BUSY_WAIT_S),
                                        max(0.0, deadline - loop.time())))
                busy.clear()
                continue
            if att.prefill is None or self._registry.get(att.prefill_id) is None:
                att.prefill = self._choose_prefill(choice, att)
            reply = await self._reserve(att, decode, deadline)
            if not isinstance(reply, Busy):
                return reply
            self.busy.inc()
            busy[decode.node_id] = reply.retry_after_ms / 1000

    async def _wait_for_nodes(self, choice: Choice, deadline: float) -> None:
        """Until both pools have a live node. A fresh request does not wait: 503 at once; one that
        is failing over waits until the deadline."""
        loop = asyncio.get_running_loop()
        while not self._is_healthy():
            if choice.num_attempts <= 1 and not choice.token_ids:
                raise NoNodeAvailable("no live prefill and decode nodes")
            if loop.time() >= deadline:
                raise NoNodeAvailable("no live prefill and decode nodes within the admission timeout")
            await asyncio.sleep(_POLL_S)
        if loop.time() >= deadline:
            raise NoNodeAvailable(f"no decode node had room within {self._config.admission_timeout_s} s")

    def _choose_decode(self, choice: Choice, busy: dict[str, float]) -> Node | None:
        nodes = [n for n in _prefer(self._registry.candidates(NodeRole.DECODE), choice.avoid)
                 if n.node_id not in busy]
        return self._decode_policy.choose(nodes) if nodes else None

    def _choose_prefill(self, choice: Choice, att: Attempt) -> PrefillChoice:
        nodes = _prefer(self._registry.candidates(NodeRole.PREFILL), choice.avoid)
        block_size = self._server.block_size
        hashes = chain_hashes(att.prompt_ids, block_size)
        return self._prefill_policy.choose(nodes, hashes, -(-len(att.prompt_ids) // block_size))

    async def _reserve(self, att: Attempt, decode: Node, deadline: float) -> Reserved | Busy | Failure:
        """Step 2: DecodeRequest to D, and its answer."""
        att.decode_id = decode.node_id
        att.contacted.add(decode.node_id)
        self._server.send(decode.node_id, DecodeRequest(att.wire_rid, att.prompt_ids, att.params,
                                                        att.prefill_id, att.base))
        while True:
            try:
                event = await asyncio.wait_for(att.inbox.get(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise NoNodeAvailable(f"decode node {decode.node_id} did not answer within the "
                                      f"admission timeout") from None
            if isinstance(event, Lost):
                return Failure(event.node_id, f"node {event.node_id} lost ({event.reason})", True)
            node_id, msg = event
            if node_id != att.decode_id:
                continue
            if isinstance(msg, RequestFailed):
                return Failure(node_id, f"{node_id}: {msg.reason}", msg.retryable)
            if isinstance(msg, Busy):
                att.contacted.discard(node_id)
                att.decode_id = ""
                return msg
            if isinstance(msg, Reserved):
                self._begin(att, node_id, len(msg.dst_block_ids))
                self._send_prefill(att, decode, msg)
                return None

    def _send_prefill(self, att: Attempt, decode: Node, reserved: Reserved) -> None:
        """Step 3: PrefillRequest to P, shipping into D's reservation."""
        att.contacted.add(att.prefill_id)
        self._begin(att, att.prefill_id, att.prefill.new_blocks)
        self._server.send(att.prefill_id, PrefillRequest(
            att.wire_rid, att.prompt_ids, att.params, decode.endpoint, reserved.xfer_id,
            reserved.dst_block_ids, reserved.cached_prefix_blocks, att.base))

    def _begin(self, att: Attempt, node_id: str, blocks: int) -> None:
        self._registry.begin(node_id, blocks)
        att.begun[node_id] = att.begun.get(node_id, 0) + blocks


def _prefer(nodes: list[Node], avoid: set[str]) -> list[Node]:
    """The nodes not to avoid, or all of them if none is left."""
    return [n for n in nodes if n.node_id not in avoid] or nodes
