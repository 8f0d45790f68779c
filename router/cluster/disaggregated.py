"""Disaggregated mode: prefill and decode on separate node processes, over the control plane.

Life of one choice of a request (n > 1 runs n of them, `rid#i`, with seed + i):

    1. pick a decode node D and a prefill node P, or none when D computes the prompt itself
       (--routing cost: cached overlap and load, router/cluster/routing_cost.py; affinity:
       D least loaded with room, P by prefix affinity, then load), and book the request on them
       at once, so a burst spreads (router/cluster/bookings.py)
    2. D ◀─DecodeRequest─ router; D ─▶ Reserved, or Busy: try another D, or wait for room;
       no reservation within admission_timeout_s fails the request (503); a structured output's
       grammar is compiled on D and P at once before it, and only then booked
       (router/cluster/grammar_first.py); P's Busy there: another P, or P after its retry hint
    3. P ◀─PrefillRequest(D's kv_endpoint, xfer_id, dst_block_ids)─ router   (steps 1-3: admission.py)
    4. P ─FirstToken─▶ client at once; D ─TokenDelta...─▶ client, merged by token index and text
       offset, so a token D re-sends is not emitted twice; the client is sent deltas only, less
       the text a stop string may still claim (router/stop_hold.py)
    5. P or D fails or leaves (RequestFailed, heartbeat timeout, new epoch, goodbye, an operator's
       remove or drain deadline: router/cluster/node_operator.py; P's RequestFailed after its first
       token too: its transfer to D broke, e.g. its Commit's send timed out, and D would hold the
       reservation until its lease; P lost after its first token is not: D reports a transfer
       that broke itself; P's Busy is no failure: admission.py): AbortRequest to both,
       then a new attempt on other nodes from prompt + the tokens emitted so far, with max_tokens
       and min_tokens less those tokens: a retry before the first token, a migration after it
       (an operator's remove or drain deadline first moves D's requests with their KV blocks:
       router/cluster/kv_move.py; this re-prefill is the fallback); at most max_retries times
       after failures of the request's own: a move an operator causes uses none
    6. client gone / generator closed / abort(): AbortRequest to the nodes of the attempt

An attempt is one try on one (P, D) pair. Its wire rid is the choice's rid, then `rid~k` for try k,
so a late message from an earlier attempt is never taken for the current one's.

    choice's tokens: [0 .......... base) [base ...................... base + n)
                      earlier attempts    this attempt's token i is choice token base + i
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Iterable

from prometheus_client import Counter, Histogram

from pdwire.outputs import RequestOutput
from pdwire.sampling_params import SamplingParams, choice_seed
from pdwire import control
from pdwire.control import AbortRequest
from pdwire.schema import MAX_RID_LEN
from router.cluster.admission import Admission, CapacityWatch
from router.backend import Backend, NodeMetrics
from router.cluster.disagg_request import (Attempt, Choice, Failure, Lost, PendingRequest, TransferTimer, apply_event,
                                           check_control_size)
from router.config import RouterConfig
from router.cluster.control_server import ControlServer
from router.cluster.membership import NodeLoss
from router.http.metrics import LATENCY_BUCKETS
from router.cluster.kv_index import KVIndex
from router.cluster.kv_move import REPREFILL, UNTIMED, KVMoves, MoveOut
from router.cluster.node_operator import NodeOperator
from router.cluster.policy import PrefixAffinity
from router.cluster.registry import NodeRegistry, NodeRole

log = logging.getLogger(__name__)

_ABORTED = object()         # put in a request's events by abort(): its stream ends
MAX_PROMPT_LOGPROB_PAIRS = 400_000   # ~6 MB of FirstToken, well under the control plane's 16 MiB


class DisaggregatedBackend(Backend):
    """Serves through prefill and decode nodes; call `await start()` on the serving loop first
    (generate() starts it too). The nodes connect to `control_endpoint` and say hello."""

    def __init__(self, tokenizer: Any, model_name: str, max_model_len: int, secret: bytes,
                 config: RouterConfig = RouterConfig(), vocab_size: int | None = None):
        """secret: the cluster secret every node must prove it holds (kvtransport.secret)."""
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._model_max_len = max_model_len
        self._vocab_size = vocab_size
        self._vocab = vocab_size or (1 << 31)   # token ids are checked against it
        self._config = config
        capacity = CapacityWatch()
        registry = NodeRegistry(config.heartbeat_timeout_s, on_capacity=capacity.notify)
        self._server = ControlServer(registry, self, secret, config.control_endpoint,
                                     expire_interval_s=min(0.25, config.heartbeat_timeout_s / 4))
        self._affinity = PrefixAffinity(config.affinity_blocks_per_node)
        self._kv_index = KVIndex(config.kv_index_max_blocks)
        self._admission = Admission(config, registry, self._server, self._affinity, capacity, self._kv_index)
        self._requests: dict[str, PendingRequest] = {}
        self._attempts: dict[str, Attempt] = {}
        self._retries = Counter("pdserve_router_retries", "Requests run again before their first "
                                "token after a node failed (or a prefill node was busy), by cause.", ["cause"],
                                registry=None)
        self._migrations = Counter("pdserve_router_migrations", "Requests moved to other nodes after tokens "
                                   "were emitted, by cause and how: with their KV blocks (kv_move) or "
                                   "re-prefilled from prompt + emitted tokens (reprefill).", ["cause", "how"],
                                   registry=None)
        self._moves = KVMoves(config.kv_move_timeout_s, self._server, self._admission, self._attempts,
                              self._attempt, self._end_attempt, self._migrations, self._vocab)
        self._operator = NodeOperator(self._server, self._moves, 2 * config.kv_move_timeout_s)
        self._kv_transfer_time = Histogram("pdserve_kv_transfer_time_seconds", TransferTimer.__doc__,
                                           buckets=LATENCY_BUCKETS, registry=None)

    @classmethod
    def from_model(cls, path: str, secret: bytes, config: RouterConfig = RouterConfig()) -> DisaggregatedBackend:
        """Tokenizer, name and context from the local model folder the nodes serve (a folder
        without a tokenizer serves token-id prompts only)."""
        from router.model_facts import load_tokenizer, read_model_facts

        facts = read_model_facts(path)
        return cls(load_tokenizer(path), facts.name, facts.max_model_len, secret, config, facts.vocab_size)

    async def start(self) -> str:
        """Binds the control socket on the running loop; returns its endpoint. Idempotent."""
        return await self._server.start()

    @property
    def control_endpoint(self) -> str | None:
        return self._server.endpoint

    @property
    def server(self) -> ControlServer:
        return self._server

    @property
    def kv_index(self) -> KVIndex:
        return self._kv_index

    @property
    def operator(self) -> NodeOperator:
        return self._operator

    def note_restart(self, node_id: str) -> None:
        """A supervisor restarted the node's process: counted in pdserve_router_node_restarts."""
        self._operator.note_restart(node_id)

    # ------------------------------------------------------------ Backend

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        nodes = self._server.max_model_len
        return self._model_max_len if nodes is None else min(nodes, self._model_max_len)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        request = self._new_request(request_id, prompt, params)
        self._requests[request_id] = request
        yielded = False
        try:
            await self.start()
            request.tasks = [asyncio.create_task(self._run_choice(request, c)) for c in request.choices]
            while True:
                for event in await _drain(request.events):
                    if event is _ABORTED:
                        return
                    if isinstance(event, BaseException):
                        raise event if not yielded or not isinstance(event, ValueError) \
                            else RuntimeError(str(event))
                output = request.take()
                if output is None:
                    continue
                yielded = True
                yield output
                if output.finished:
                    return
        finally:
            self._stop(request)

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            request.events.put_nowait(_ABORTED)
            self._stop(request)

    def placement(self, request_id: str) -> list[tuple[str, str]]:
        """(prefill node, decode node) each choice of the request runs on now; [] if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        return [(c.attempt.prefill_id, c.attempt.decode_id) if c.attempt else ("", "")
                for c in request.choices]

    def metrics(self) -> list[NodeMetrics]:
        return self._server.node_metrics()

    def is_healthy(self) -> bool:
        return self._server.count(NodeRole.PREFILL) > 0 and self._server.count(NodeRole.DECODE) > 0

    def collectors(self) -> Iterable[Any]:
        return (self._retries, self._migrations, self._admission.busy, self._admission.prefills,
                self._kv_index.evictions, self._kv_index.size_gauge, self._server.dropped,
                *self._server.membership.collectors(), self._kv_transfer_time)

    def close(self) -> None:
        for request in list(self._requests.values()):
            request.events.put_nowait(RuntimeError("the router is shutting down"))
            self._stop(request)
        self._operator.close()
        self._server.close()

    # ------------------------------------------------------------ control plane (ControlListener)

    def on_request_message(self, node_id: str, msg: Any) -> bool:
        att = self._attempts.get(msg.rid)
        if att is None or node_id not in (att.prefill_id, att.decode_id, att.writer):
            return False
        self._admission.bookings.on_message(att, node_id, msg)
        att.inbox.put_nowait((node_id, msg))
        return True

    def on_kv_events(self, node_id: str, msg: control.KVEvents) -> None:
        self._kv_index.apply(node_id, msg.stored, msg.removed, msg.reset)

    def on_node_lost(self, node_id: str, loss: NodeLoss) -> None:
        self._affinity.forget(node_id)
        self._kv_index.forget(node_id)
        for att in self._attempts.values():
            if node_id in (att.prefill_id, att.decode_id, att.writer):
                att.inbox.put_nowait(Lost(node_id, loss))

    # ------------------------------------------------------------ a request

    def _new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> PendingRequest:
        """Validates; raises ValueError for a request the nodes would refuse."""
        if not request_id or len(request_id) > MAX_RID_LEN - 8:
            raise ValueError(f"request id must have 1 to {MAX_RID_LEN - 8} characters")
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.use_beam_search:
            raise ValueError("use_beam_search is served by the colocated mode only: beams share one "
                             "node's blocks")
        prompt_ids = self._prompt_ids(prompt)
        if params.prompt_logprobs is not None and \
                len(prompt_ids) * (params.prompt_logprobs + 1) > MAX_PROMPT_LOGPROB_PAIRS:
            raise ValueError(f"prompt_logprobs: {len(prompt_ids)} prompt tokens x {params.prompt_logprobs + 1} "
                             f"logprobs is over {MAX_PROMPT_LOGPROB_PAIRS} (they travel in one control message)")
        vocab = self._vocab
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len} "
                             "tokens, including at least one output token")
        check_control_size(request_id, prompt_ids, params, self._server.block_size or 1)
        choices = []
        for i in range(params.n):
            seed = None if params.seed is None else choice_seed(params.seed, i)
            choice = Choice(i, request_id if params.n == 1 else f"{request_id}#{i}",
                             dataclasses.replace(params, n=1, seed=seed))
            choices.append(choice)
        return PendingRequest(request_id, prompt_ids, choices)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise ValueError("the router has no tokenizer: pass token ids")
            ids = list(self._tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self._vocab
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _stop(self, request: PendingRequest) -> None:
        """Cancels the request's choices and aborts their attempts on the nodes; idempotent."""
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        for task in request.tasks:
            task.cancel()
        for choice in request.choices:
            if choice.attempt is not None:
                self._end_attempt(choice.attempt)

    # ------------------------------------------------------------ a choice: attempts until it ends

    async def _run_choice(self, request: PendingRequest, choice: Choice) -> None:
        cause = ""      # why the last attempt failed
        try:
            while choice.finish_reason is None:
                att = self._next_attempt(request, choice, cause)
                if att is None:
                    break
                failure = await self._run_attempt(request, choice, att)
                if failure is not None:
                    self._after_failure(choice, failure)
                    cause = failure.cause
        except Exception as err:    # noqa: BLE001 -- handed to generate(), which raises it
            request.events.put_nowait(err)

    async def _run_attempt(self, request: PendingRequest, choice: Choice, att: Attempt) -> Failure | None:
        """Admits and streams an attempt, and the attempts its KV moves make; ends each one."""
        try:
            failure = await self._admission.admit(choice, att)
            if failure is None:
                request.note_admitted(choice, att, self._server.block_size or 1)
                failure = await self._stream(request, choice, att)
            while isinstance(failure, MoveOut):
                moved, failure = await self._moves.move(request, choice, att, failure)
                if moved is not None:
                    self._end_attempt(att)      # after the ShipRequest: D1's hold is no longer its
                    att = moved
                    failure = await self._stream(request, choice, att)
        finally:
            self._end_attempt(att)
        return failure

    def _next_attempt(self, request: PendingRequest, choice: Choice, cause: str) -> Attempt | None:
        """The next try from what was emitted; None (and the choice finished) if nothing is left."""
        emitted = len(choice.token_ids)
        max_tokens = None if choice.params.max_tokens is None else choice.params.max_tokens - emitted
        if (max_tokens is not None and max_tokens < 1) or len(request.prompt_ids) + emitted >= self.max_model_len:
            choice.finish("length")
            request.events.put_nowait(choice.index)
            return None
        if choice.num_attempts > 0:
            (self._migrations.labels(cause, REPREFILL) if emitted else self._retries.labels(cause)).inc()
        return self._attempt(request, choice, emitted, choice.out.length)

    def _attempt(self, request: PendingRequest, choice: Choice, emitted: int, text_base: int) -> Attempt:
        """The choice's next attempt, from prompt + its first `emitted` tokens (text_base characters)."""
        max_tokens = None if choice.params.max_tokens is None else choice.params.max_tokens - emitted
        params = dataclasses.replace(choice.params, max_tokens=max_tokens,
                                     min_tokens=max(0, choice.params.min_tokens - emitted))
        if params.prompt_logprobs is not None and (emitted or choice.index or request.prompt_logprobs):
            params = dataclasses.replace(params, prompt_logprobs=None)   # the scores come once, from
                                                                          # choice 0 before any token
        k = choice.num_attempts
        choice.num_attempts += 1
        att = Attempt(choice.rid if k == 0 else f"{choice.rid}~{k}",
                       request.prompt_ids + choice.token_ids[:emitted], params, emitted, text_base)
        choice.attempt = self._attempts[att.wire_rid] = att
        return att

    def _end_attempt(self, att: Attempt) -> None:
        """Unregisters the attempt, undoes its in-flight counts and, unless D finished it, aborts it
        on every node it reached; idempotent."""
        if att.ended:
            return
        att.ended = True
        self._attempts.pop(att.wire_rid, None)
        self._moves.ended(att)
        self._admission.bookings.release_all(att)
        if not att.decode_done:
            for node_id in sorted(att.contacted):
                self._server.send(node_id, AbortRequest(att.wire_rid))

    def _after_failure(self, choice: Choice, failure: Failure) -> None:
        """Raises if the choice may not run again; else notes the node to avoid. A prefill node's
        Busy (its grammar compiler's load) is no failure: the next attempt takes another prefill
        node, or the same once its retry hint passed, and it is a 503 only once the admission
        timeout has passed since the choice's first such answer."""
        if failure.busy:
            return self._admission.note_prefill_busy(choice, failure)
        if not failure.retryable:
            raise (RuntimeError if choice.token_ids else ValueError)(failure.reason)
        if failure.uses_retry:
            choice.retries += 1
        if choice.retries > self._config.max_retries:
            raise RuntimeError(f"request failed after {choice.num_attempts} attempts: {failure.reason}")
        choice.avoid.add(failure.node_id)
        log.warning("%s: %s; %s after %d tokens", choice.rid, failure.reason,
                    "migrating" if choice.token_ids else "retrying", len(choice.token_ids))

    # ------------------------------------------------------------ step 4: tokens

    async def _stream(self, request: PendingRequest, choice: Choice, att: Attempt) -> Failure | MoveOut | None:
        """Merges P's first token and D's deltas into the choice until it finishes, fails or moves."""
        timer = TransferTimer(UNTIMED if att.writer else self._kv_transfer_time)    # a KV move: not a prefill's
        while choice.finish_reason is None:
            event = await att.inbox.get()
            if isinstance(event, MoveOut):
                return event
            failure = apply_event(choice, att, event, request, self._vocab)
            self._moves.note(att, event)
            timer.note(event, att)
            if failure is not None:
                return failure
        return None


async def _drain(queue: asyncio.Queue) -> list[Any]:
    """The next item and any that are already waiting behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
