"""Steps 1-3 of an attempt in disaggregated mode (see router/cluster/disaggregated.py): pick a decode node
D and a prefill node P, get D's reservation, and send P its PrefillRequest into that reservation.

One admission, round by round:

    1. wait until both pools have a live node (a fresh request: 503 at once if one is empty)
    2. rank the decode nodes (policy.py; --routing cost: routing_cost.py, by cached overlap and
       load) and take the first one with room, skipping a node that said Busy to this request
       until it reports more free blocks; decide where the prompt is computed: on D itself when
       its uncached tail is short (routing cost), else on a prefill node P, skipping one that
       said Busy to it until its retry hint passes (busy_prefills.py: none left, wait for the
       first hint); a structured output with a prefill node: both compile its grammar first, at
       once (grammar_first.py: no KV is held or booked while a grammar compiles); D's Busy there
       is a Busy of step 4, P's goes to 2 again; then book the request on D (and P) at once, so
       the next request sees them taken
    3. no node has room: wait for a capacity change (a decode node's heartbeat, or work on one
       ending) or a timer (from retry_after_ms, doubling up to ADMISSION_MAX_WAIT_S, with jitter); when the
       timer fires, ask the least loaded node anyway (the router's view may be wrong); go to 1
    4. DecodeRequest to D (local_prefill: D computes the prompt): Reserved ends admission (D's
       booking now counts the blocks D says it took), and sends P its PrefillRequest unless D
       prefills; Busy releases the bookings and goes to 1
       (a KV move's reservation, reserve_move, is one round of 2 and 4: its writer is a decode node)
    5. past admission_timeout_s (from the choice's first prefill Busy, if earlier): 503 naming
       why (no live node, every decode or prefill node busy, decode nodes full, or a decode node
       that did not answer)
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from prometheus_client import Counter

from pdwire.block_hash import chain_hashes
from pdwire.control import DecodeRequest, PrefillRequest, RequestFailed
from pdwire.messages import Busy, Reserved
from router.config import ADMISSION_FIRST_WAIT_S, ADMISSION_MAX_WAIT_S, RouterConfig
from router.cluster.control_server import ControlServer
from router.cluster.bookings import Bookings
from router.cluster.busy_prefills import BusyPrefills
from router.cluster.disagg_request import Attempt, Choice, Failure, Lost
from router.cluster.grammar_first import compile_first, needs_compile
from router.cluster.kv_index import KVIndex
from router.cluster.policy import DecodePolicy, NoNodeAvailable, Pool, PrefillChoice, PrefillPolicy, PrefixAffinity
from router.cluster.registry import Node, NodeRegistry, NodeRole
from router.cluster.routing_cost import RoutingCost

_POLL_S = 0.05              # how often a failed-over request looks for a live node


class CapacityWatch:
    """Wakes every admission waiting for room when a decode node may have more of it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self, node: Node) -> None:
        if node.role is NodeRole.DECODE:
            self._event.set()
            self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> bool:
        """True if notified within `timeout_s`, False if the time ran out."""
        try:
            await asyncio.wait_for(self._event.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False


@dataclass(slots=True)
class _Rounds:
    """What one admission learned so far."""
    deadline: float
    need_blocks: int                        # D's check: prompt + growth
    refused: dict[str, int] = field(default_factory=dict)   # node -> its reported free blocks at Busy
    busy_replies: int = 0
    last_busy: str = ""
    wait_s: float = ADMISSION_FIRST_WAIT_S           # the timer's period: doubles each time it fires
    probe_at: float | None = None           # when the timer fires (loop time); None: not set
    probe: bool = False                     # the timer fired: ask the least loaded node anyway
    on_prefills: bool = False               # the last round waited for busy prefill nodes, not for room


class Admission:
    """The DisaggregatedBackend's admission of one attempt at a time; it counts Busy replies (by the
    replying node's role) and books each attempt's nodes in the registry once it picks them
    (`bookings`, bookings.py)."""

    def __init__(self, config: RouterConfig, registry: NodeRegistry, server: ControlServer,
                 affinity: PrefixAffinity, capacity: CapacityWatch, index: KVIndex):
        self._config, self._registry, self._server, self._capacity = config, registry, server, capacity
        self._decode_policy = DecodePolicy(self._pool, config.policy_seed)
        self._cost: RoutingCost | None = None
        if config.routing == "cost":
            self._cost = RoutingCost(index, self._decode_policy, config.decode_load_weight,
                                     config.local_prefill_tokens, config.policy_seed,
                                     (config.decode_balance_abs, config.decode_balance_rel))
        self._prefill_policy = PrefillPolicy(index if self._cost else affinity, config.prefill_load_weight)
        self._rng = random.Random(config.policy_seed)
        self.bookings = Bookings(registry)
        self.busy = Counter("pdserve_router_busy_replies", "Busy replies from nodes, by the role of the node "
                            "that sent it: a decode node's KV blocks, a prefill node's grammar compiler.",
                            ["role"], registry=None)
        for role in NodeRole:
            self.busy.labels(role.value)        # both series from the start, at 0
        self.prefills = Counter("pdserve_router_prefills", "Prompts admitted, by where they were computed: "
                                "on a prefill node (remote) or on their decode node (local).", ["where"],
                                registry=None)

    async def admit(self, choice: Choice, att: Attempt) -> Failure | None:
        """Picks P and D and gets D's reservation. Raises NoNodeAvailable when that cannot happen."""
        loop = asyncio.get_running_loop()
        rounds = _Rounds(min(loop.time() + self._config.admission_timeout_s,
                             choice.busy_prefills.deadline or float("inf")), 0)
        while True:
            await self._wait_for_nodes(choice, rounds.deadline)
            if loop.time() >= rounds.deadline:
                raise NoNodeAvailable(self._timeout_reason(rounds, choice))
            rounds.on_prefills = False
            rounds.need_blocks = self._need_blocks(att)
            hashes = chain_hashes(att.prompt_ids, self._server.block_size)
            decode = self._choose_decode(choice, rounds, att, hashes)
            if decode is None:
                await self._wait_for_room(rounds)
                continue
            att.local = self._prefill_here(decode, att, hashes)
            att.prefill = None if att.local else self._choose_prefill(choice, att, hashes)
            if not att.local and att.prefill is None:
                rounds.on_prefills = True
                await self._wait_for_prefill(choice, rounds)
                continue
            reply = None
            if needs_compile(att):
                reply = await compile_first(self._server, att, decode, rounds.deadline,
                                            self._config.admission_timeout_s)
            if isinstance(reply, Failure) and reply.busy:
                self.note_prefill_busy(choice, reply)
                rounds.on_prefills = True
                continue
            if reply is None:
                self._book(att, decode, hashes)     # after the compiles: a slow one holds no capacity
                reply = await self._reserve(att, decode, rounds.deadline)
            if reply is None and att.local:     # D computes the prompt: a later prefill Busy is a new wait
                choice.busy_prefills = BusyPrefills()
            if not isinstance(reply, Busy):
                return reply
            self._on_busy(att, decode, reply, rounds)
            self._rearm(rounds)

    async def reserve_move(self, choice: Choice, att: Attempt) -> Reserved | Busy | Failure | None:
        """A KV move's reservation, written by att.writer: one ask of the first ranked decode node
        with room within kv_move_timeout_s (no waiting for room); None if none has room.
        Raises NoNodeAvailable if the node does not answer in time."""
        loop = asyncio.get_running_loop()
        rounds = _Rounds(loop.time() + self._config.kv_move_timeout_s, self._need_blocks(att))
        hashes = chain_hashes(att.prompt_ids, self._server.block_size)
        decode = self._choose_decode(choice, rounds, att, hashes)
        if decode is None or decode.node_id == att.writer:
            return None
        self._book(att, decode, hashes)
        reply = await self._reserve(att, decode, rounds.deadline)
        if isinstance(reply, Busy):
            self._on_busy(att, decode, reply, rounds)
        return reply

    async def _wait_for_nodes(self, choice: Choice, deadline: float) -> None:
        """Until both pools have a live node. A fresh request does not wait: 503 at once; one that
        is failing over waits until the deadline."""
        loop = asyncio.get_running_loop()
        while missing := self._missing_pools():
            if choice.num_attempts <= 1 and not choice.token_ids:
                raise NoNodeAvailable(f"no live {missing} node")
            if loop.time() >= deadline:
                raise NoNodeAvailable(f"no live {missing} node within the admission timeout of "
                                      f"{self._config.admission_timeout_s} s")
            await asyncio.sleep(_POLL_S)

    def _missing_pools(self) -> str:
        """'prefill', 'decode', 'prefill or decode', or '' when both pools have a live node."""
        return " or ".join(r.value for r in NodeRole if not self._registry.candidates(r))

    def _choose_decode(self, choice: Choice, rounds: _Rounds, att: Attempt, hashes: list[bytes]) -> Node | None:
        """The first ranked decode node with room that has not refused the request; when the
        timer fired, the first one whatever it said."""
        nodes = _prefer(self._registry.candidates(NodeRole.DECODE), choice.avoid)
        if self._cost is None:
            ranked = self._decode_policy.rank(nodes)
        else:
            ranked = self._cost.rank(nodes, hashes, len(att.prompt_ids), self._server.block_size)
        fit = next((n for n in ranked if not self._refused(n, rounds)
                    and self._decode_policy.has_room(n, rounds.need_blocks)), None)
        return ranked[0] if fit is None and rounds.probe else fit

    def _refused(self, node: Node, rounds: _Rounds) -> bool:
        """The node said Busy to this request and has not reported more free blocks since."""
        free = rounds.refused.get(node.node_id)
        return free is not None and self._pool(node).free_blocks <= free

    async def _wait_for_room(self, rounds: _Rounds) -> None:
        """Step 3: until a decode node may have more room, or the timer fires (a heartbeat
        does not restart the timer); at once past the deadline (the next round's 503)."""
        now = asyncio.get_running_loop().time()
        if rounds.probe_at is None:
            rounds.probe_at = now + self._jittered(rounds.wait_s)
        await self._capacity.wait(min(rounds.probe_at, rounds.deadline) - now)
        if asyncio.get_running_loop().time() >= rounds.probe_at:
            rounds.probe, rounds.probe_at = True, None
            rounds.wait_s = min(2 * rounds.wait_s, ADMISSION_MAX_WAIT_S)

    def _jittered(self, wait_s: float) -> float:
        """wait_s to 1.5 x wait_s, so waiting requests do not ask in step."""
        return wait_s * (1.0 + 0.5 * self._rng.random())

    def _timeout_reason(self, rounds: _Rounds, choice: Choice) -> str:
        timeout = self._config.admission_timeout_s
        if choice.busy_prefills.replies and rounds.on_prefills:
            return choice.busy_prefills.reason(timeout)
        if rounds.busy_replies:
            return (f"every decode node was busy for the admission timeout of {timeout} s "
                    f"({rounds.busy_replies} Busy replies; last: {rounds.last_busy})")
        return (f"no decode node had room for {rounds.need_blocks} KV blocks (by their last reports) "
                f"within the admission timeout of {timeout} s")

    def _on_busy(self, att: Attempt, decode: Node, reply: Busy, rounds: _Rounds) -> None:
        """D said Busy: counted, the attempt's bookings released, and D noted in `rounds` as
        refusing until it reports more free blocks."""
        self.busy.labels(NodeRole.DECODE.value).inc()
        self.bookings.release_all(att)
        rounds.refused[decode.node_id] = self._pool(decode).free_blocks
        rounds.busy_replies += 1
        rounds.last_busy = f"{decode.node_id}: {reply.reason or 'busy'}"
        rounds.wait_s = max(rounds.wait_s, reply.retry_after_ms / 1000)

    def _rearm(self, rounds: _Rounds) -> None:
        """After a Busy, the timer starts again from now (and no node is asked anyway until it fires)."""
        rounds.probe_at = asyncio.get_running_loop().time() + self._jittered(rounds.wait_s)
        rounds.probe = False

    def _prefill_here(self, decode: Node, att: Attempt, hashes: list[bytes]) -> bool:
        """Whether D computes the prompt (routing cost, a short uncached tail). Prompt logprobs
        come with a prefill node's first token, so such a request always has one."""
        return self._cost is not None and att.params.prompt_logprobs is None and \
            self._cost.prefill_here(decode, hashes, len(att.prompt_ids), self._server.block_size)

    def _choose_prefill(self, choice: Choice, att: Attempt, hashes: list[bytes]) -> PrefillChoice | None:
        """The attempt's prefill node: the one chosen in an earlier round while it is still a
        candidate (its prefix was recorded there), else the policy's choice; a node that said Busy
        to the choice is no candidate until its retry hint passes (None while none is left)."""
        now = asyncio.get_running_loop().time()
        nodes = [n for n in self._registry.candidates(NodeRole.PREFILL)
                 if not choice.busy_prefills.refused(n.node_id, now)]
        if not nodes:
            return None
        nodes = _prefer(nodes, choice.avoid)
        if att.prefill is not None and any(n is att.prefill.node for n in nodes):
            return att.prefill
        return self._prefill_policy.choose(nodes, hashes, -(-len(att.prompt_ids) // self._server.block_size))

    async def _wait_for_prefill(self, choice: Choice, rounds: _Rounds) -> None:
        """Every live prefill node said Busy to the choice: until the first retry hint passes."""
        now = asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, min(choice.busy_prefills.next_retry(now), rounds.deadline) - now))

    def note_prefill_busy(self, choice: Choice, failure: Failure) -> None:
        """A prefill node said Busy to the choice (its grammar compiler's load): it is asked again
        once its retry hint passes, another one at once; the choice's admission timeout runs from
        the first such answer: past it, raises NoNodeAvailable (a 503)."""
        self.busy.labels(NodeRole.PREFILL.value).inc()
        now, timeout = asyncio.get_running_loop().time(), self._config.admission_timeout_s
        choice.busy_prefills.note(failure.node_id, failure.reason, failure.retry_after_s, now, timeout)
        if choice.busy_prefills.timed_out(now):
            raise NoNodeAvailable(choice.busy_prefills.reason(timeout))

    def _book(self, att: Attempt, decode: Node, hashes: list[bytes]) -> None:
        self.bookings.book(att, decode.node_id, self._decode_blocks(att, decode, hashes))

    async def _reserve(self, att: Attempt, decode: Node, deadline: float) -> Reserved | Busy | Failure | None:
        """Step 4: DecodeRequest to D, and its answer."""
        att.decode_id = decode.node_id
        att.contacted.add(decode.node_id)
        self._server.send(decode.node_id, DecodeRequest(att.wire_rid, att.prompt_ids, att.params,
                                                        att.writer or att.prefill_id or decode.node_id, att.base,
                                                        att.local))
        while True:
            event = await att.next_event(deadline, lambda: f"decode node {decode.node_id} did not answer the "
                                         "reservation within the admission timeout of "
                                         f"{self._config.admission_timeout_s} s")
            if isinstance(event, Lost):     # (one of an earlier round's nodes: not this round's failure)
                if event.node_id in (decode.node_id, att.prefill_id, att.writer):
                    return event.failure()
                continue
            node_id, msg = event
            if node_id != att.decode_id:
                continue
            if isinstance(msg, RequestFailed):
                return Failure(node_id, f"{node_id}: {msg.reason}", msg.retryable)
            if isinstance(msg, Busy):
                att.contacted.discard(node_id)
                att.decode_id = ""
                return msg
            if isinstance(msg, Reserved):       # taken as it arrived (bookings.py)
                att.cached_blocks = msg.cached_prefix_blocks
                if att.writer:                  # a KV move: the writer ships (router/cluster/kv_move.py)
                    return msg
                self.prefills.labels("local" if att.local else "remote").inc()
                if att.local:
                    att.first_token = True      # D's deltas carry every token from the first
                else:
                    self._send_prefill(att, decode, msg)
                return None

    def _send_prefill(self, att: Attempt, decode: Node, reserved: Reserved) -> None:
        """PrefillRequest to P, shipping into D's reservation."""
        att.contacted.add(att.prefill_id)
        self.bookings.taken(att, att.prefill_id)
        self._server.send(att.prefill_id, PrefillRequest(
            att.wire_rid, att.prompt_ids, att.params, decode.endpoint, reserved.xfer_id,
            reserved.dst_block_ids, reserved.cached_prefix_blocks, att.base))

    def _pool(self, node: Node) -> Pool:
        """The node's KV pool by its hello and latest heartbeat (before any: all blocks free)."""
        info = self._server.info(node.node_id)
        if info is None:
            return Pool(0, 0)
        status = info.status
        return Pool(info.hello.num_blocks, info.hello.num_blocks if status is None else status.num_free_blocks)

    def _decode_blocks(self, att: Attempt, decode: Node, hashes: list[bytes]) -> int:
        """Blocks D allocates at once, as the router estimates them before D answers: the
        prompt's, less the leading ones its prefix cache holds by the KV index (routing cost: the
        overlap the ranking used), which D shares rather than allocates again; a request with
        prompt logprobs computes, and allocates, every block.

        A held block that no running request references is counted free by D until one does, so
        this undercounts what D takes by such blocks, and a stale index errs either way. D's
        Reserved says what it took (taken_blocks), and Bookings.taken re-books that: the view is exact
        from the reply on, until a release (registry.py: a request ending frees only its blocks no
        other request shares, while the release takes off all it took). The estimate does not book the overlap: the router cannot tell idle
        held blocks from referenced ones, and in a burst on one document they are referenced
        (its earlier questions still run), where booking them would count the document once per
        request, making the node that holds it look as dear as one that lacks it."""
        held = 0
        if self._cost is not None and att.params.prompt_logprobs is None:
            held = self._cost.overlap(decode, hashes, len(att.prompt_ids), self._server.block_size)
        return -(-len(att.prompt_ids) // self._server.block_size) - held

    def _need_blocks(self, att: Attempt) -> int:
        """Blocks D must have free to take the request: the prompt's and its growth's."""
        room = (self._server.max_model_len or 0) - len(att.prompt_ids)
        growth = max(0, min(room, att.params.max_tokens or room))
        return -(-(len(att.prompt_ids) + growth) // self._server.block_size)


def _prefer(nodes: list[Node], avoid: set[str]) -> list[Node]:
    """The nodes not to avoid, or all of them if none is left."""
    return [n for n in nodes if n.node_id not in avoid] or nodes
