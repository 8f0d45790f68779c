"""The per-request records of the disaggregated backend, and how a node's tokens merge into what
the client is sent (router/cluster/disaggregated.py runs the lifecycle). A choice keeps every
token it merged (a next attempt continues from them) but of its text only the tail that the stop
hold (router/stop_hold.py) has not released: the router yields deltas, never the text so far."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from pdwire.outputs import RequestOutput
from pdwire.schema import MAX_RID_LEN
from pdwire.sampling_params import SamplingParams
from pdwire import control
from pdwire.control import TRANSFER_FAILED, UNREACHABLE_DECODE, FirstToken, PrefillRequest, RequestFailed, TokenDelta
from pdwire.messages import Busy
from router.backend import NoNodeAvailable
from router.cluster.busy_prefills import BusyPrefills
from router.cluster.membership import BUSY, NODE_FAILURE, OPERATOR_CAUSES, NodeLoss
from router.cluster.policy import PrefillChoice
from router.cluster.registry import Booking
from router.request_deltas import RequestDeltas
from engine.detokenizer import find_stop
from router.stop_hold import StopHold

log = logging.getLogger(__name__)
MAX_BLOCK_ID = (1 << 31) - 1        # the widest block id on the wire (sizes check_control_size's probe)


class Lost(NamedTuple):
    """In an attempt's inbox: one of its nodes died, restarted or left."""
    node_id: str
    loss: NodeLoss
    overdue: bool = False   # put back kv_move_timeout_s after a KV move's writer was lost (KVMoves.note)

    def failure(self) -> Failure:
        return Failure(self.node_id, f"node {self.node_id} lost ({self.loss})", True, self.loss.cause.value)


class Failure(NamedTuple):
    """Why an attempt ended early."""
    node_id: str            # the node to avoid on the next attempt
    reason: str
    retryable: bool
    cause: str = NODE_FAILURE   # a LossCause's value when a node was lost: the retry's metric label
    retry_after_s: float | None = None  # a prefill node's Busy (its grammar compiler's load): ask
                                        # again after this, within the admission timeout (busy_prefills.py)

    @property
    def busy(self) -> bool:
        return self.retry_after_s is not None

    @property
    def uses_retry(self) -> bool:
        """Whether the next attempt uses one of the request's max_retries: not when an operator's
        remove or drain deadline moved it (router/cluster/node_operator.py), a KV move that failed
        included, nor after a Busy; that is no failure of the request."""
        return self.cause not in OPERATOR_CAUSES and not self.busy

    @classmethod
    def prefill_busy(cls, node_id: str, busy: Busy) -> Failure:
        return cls(node_id, f"{node_id}: {busy.reason or 'busy'}", True, BUSY, busy.retry_after_ms / 1000)


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of a choice on one (P, D) pair."""
    wire_rid: str
    prompt_ids: list[int]           # the request's prompt + the tokens emitted before this attempt
    params: SamplingParams          # n = 1; max_tokens and min_tokens less the emitted tokens
    base: int                       # tokens emitted before: token i here is choice token base + i
    text_base: int                  # characters of text emitted before this attempt's text
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)    # (node_id, msg) | Lost
    prefill: PrefillChoice | None = None       # None when D computes the prompt (local)
    decode_id: str = ""
    local: bool = False             # D prefills the prompt itself and samples its first token
    first_token: bool = False       # P's FirstToken merged (local: D reserved): D's deltas may follow
    cached_blocks: int = 0          # leading prompt blocks D had in its prefix cache (Reserved)
    decode_done: bool = False       # D sent its last delta: nothing is left to abort
    held: list[TokenDelta] = field(default_factory=list)        # D's deltas that would leave a gap
    contacted: set[str] = field(default_factory=set)            # nodes that got a request
    bookings: dict[str, Booking] = field(default_factory=dict)  # by node id: to release at the end
    ended: bool = False
    writer: str = ""                # a KV move: the decode node shipping D its blocks, until D's first delta
    streaming: bool = False         # D's first delta merged: its blocks are in, the request decodes there

    def __post_init__(self) -> None:
        if len(self.wire_rid) > MAX_RID_LEN:    # its `~k` suffix grows with each attempt (none bounds them all)
            raise RuntimeError(f"request failed: its attempt id {self.wire_rid[:24]}... would pass {MAX_RID_LEN} "
                               "characters (too many attempts)")

    @property
    def prefill_id(self) -> str:
        return self.prefill.node.node_id if self.prefill is not None else ""

    async def next_event(self, deadline: float, late: Callable[[], str]) -> Any:
        """The inbox's next entry, (node_id, msg) or Lost, by `deadline` (loop time); else raises
        NoNodeAvailable(late())."""
        try:
            return await asyncio.wait_for(self.inbox.get(), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            raise NoNodeAvailable(late()) from None


@dataclass(slots=True, eq=False)
class Choice:
    """One completion of a request, across attempts."""
    index: int
    rid: str
    params: SamplingParams          # n = 1, this choice's seed
    out: StopHold = field(init=False)   # its tokens, text and logprobs; what is not sent yet; its end
    attempt: Attempt | None = None
    num_attempts: int = 0
    retries: int = 0                # attempts after a failure that uses a retry (Failure.uses_retry)
    avoid: set[str] = field(default_factory=set)    # nodes that failed this choice
    busy_prefills: BusyPrefills = field(default_factory=BusyPrefills)  # prefill nodes that said Busy to it

    def __post_init__(self) -> None:
        self.out = StopHold(self.index, self.params)

    @property
    def finish_reason(self) -> str | None:
        """Why the choice ended (None while it runs): its stop hold's, the one record of it."""
        return self.out.finish_reason

    @property
    def token_ids(self) -> list[int]:
        """Every token merged, released or not: its stop hold's, the one record of them."""
        return self.out.token_ids

    def finish(self, reason: str) -> None:
        self.out.finish(reason)


@dataclass(slots=True, eq=False)
class PendingRequest:
    request_id: str
    prompt_ids: list[int]
    choices: list[Choice]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)   # choice index | exception | the abort marker
    tasks: list[asyncio.Task] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None   # from choice 0's first prefill
    num_cached_tokens: int | None = None    # prompt tokens D found cached, by choice 0's first reservation
    arrival: float = field(default_factory=time.monotonic)
    queue_time: float | None = None         # arrival until choice 0's first PrefillRequest went out
    sent: RequestDeltas = field(default_factory=RequestDeltas)  # scored: prompt scores went, or choices without

    def note_admitted(self, choice: Choice, att: Attempt, block_size: int) -> None:
        """At choice 0's first admission: the prompt tokens D held cached (whole blocks; at least
        the last prompt token is always computed) and the time the request queued."""
        if choice.index == 0 and att.base == 0 and self.queue_time is None:
            self.num_cached_tokens = min(att.cached_blocks * block_size, len(self.prompt_ids) - 1)
            self.queue_time = time.monotonic() - self.arrival

    def take(self) -> RequestOutput | None:
        """What the choices merged since the last take, or None if nothing. When the prompt's
        scores are asked for, no choice goes out before them: they come with choice 0's first
        token, or never (its node sent none that fit)."""
        finished = all(c.finish_reason is not None for c in self.choices)
        asked = self.choices[0].params.prompt_logprobs is not None
        if asked and self.prompt_logprobs is None and not self.choices[0].token_ids and not finished:
            return None
        delta = self.sent.take((c.out for c in self.choices), self.prompt_logprobs, finished)
        if delta is None:
            return None
        return RequestOutput(self.request_id, self.prompt_ids, delta.outputs, finished, delta.prompt_logprobs,
                             self.num_cached_tokens or 0, self.queue_time)


def merge(choice: Choice, att: Attempt, index: int, token_ids: tuple[int, ...], text_offset: int,
           text: str, logprobs: tuple | None, finish_reason: str) -> bool:
    """Merges the attempt's tokens [index, index + len(token_ids)) and the text at text_offset into
    the choice, skipping what it already has. False, merging nothing, if that would leave a gap.
    A last message's text is final: text merged before and cut since (the stop string it
    completes) is cut here too; the stop hold kept it from the client.

    logprobs has one entry per token, or fewer: then the entries belong to the last tokens. An
    empty entry has no logprob (D's for the first token, which P's FirstToken carries).
    """
    out = choice.out
    start, text_start = att.base + index, att.text_base + text_offset
    if start > len(choice.token_ids) or text_start > out.length:
        return False
    unlogged = len(token_ids) - len(logprobs or ())     # leading tokens without an entry
    new = token_ids[len(choice.token_ids) - start:]
    entries = None
    if out.logprobs is not None:
        entries = [top_logprobs(logprobs[k - unlogged]) if k >= unlogged and logprobs[k - unlogged]
                   else missing_logprob(token_ids[k]) for k in range(len(token_ids) - len(new), len(token_ids))]
    before = out.length
    out.add(new, entries, text[before - text_start:])
    if finish_reason == "stop" and choice.params.stop:
        _cut_at_stop(choice, att, before, text_start + len(text))
    if att.text_base and before < att.text_base + out.window and \
            (at := stop_across(out, att.text_base, choice.params.stop))[0] != -1:     # only near the seam
        out.cut(at[1] if choice.params.include_stop_str_in_output else at[0])
        finish_reason = "stop"
    if finish_reason:
        choice.finish(finish_reason)
    return True


def _cut_at_stop(choice: Choice, att: Attempt, before: int, end: int) -> None:
    """The node's final text ends at `end` (a stop string cut it). Text is only taken back as far
    as the stop string can reach: the stop hold keeps that much from the client (the longest
    stop string less one character); a node asking for more is ignored."""
    floor = max(att.text_base, before - choice.out.hold)
    if end < floor:
        log.warning("%s: the node cut its text to %d characters; only %d may go", att.wire_rid, end, floor)
    choice.out.cut(max(end, floor))


def stop_across(out: StopHold, boundary: int, stops: tuple[str, ...]) -> tuple[int, int]:
    """(begin, end) of the earliest stop string that ends after character `boundary` and begins
    before it, or (-1, -1). A moved request's new node sees only its own text (from `boundary` on)
    and cuts any stop string inside it, so one split between the attempts is the router's to find.
    Only the tail is searched: such a string is found by the merge that completes it, and the tail
    then still holds its start (the window: the longest stop string less one)."""
    begin, end = find_stop(out.tail, out.length - boundary, stops)
    return (-1, -1) if begin == -1 else (begin + out.base, end + out.base)


def top_logprobs(entry: Any) -> dict[int, float]:
    return {int(token): float(logprob) for token, logprob in entry}


def missing_logprob(token_id: int) -> dict[int, float]:
    log.warning("no logprob for generated token %d; reporting 0.0", token_id)
    return {token_id: 0.0}


def apply_event(choice: Choice, att: Attempt, event: Any, request: PendingRequest, vocab: int) -> Failure | None:
    """Takes one message (or node loss) of the attempt into the choice (and the prompt's scores,
    if it brings them, into `request`), and wakes the request's generator when the choice has
    something new or finished; a Failure ends the attempt."""
    before = (len(choice.token_ids), choice.out.length)
    failure = _apply(choice, att, event, request, vocab)
    if (len(choice.token_ids), choice.out.length) != before or choice.finish_reason is not None:
        request.events.put_nowait(choice.index)
    return failure


def _apply(choice: Choice, att: Attempt, event: Any, request: PendingRequest, vocab: int) -> Failure | None:
    if isinstance(event, Lost):
        if event.node_id == att.writer:     # a KV move's writer: D reports a broken transfer itself;
            return event.failure() if event.overdue else None       # overdue, D has said nothing in time
        # None: P's part is done (D reports a broken transfer); or a node the attempt no longer uses:
        # a KV move's writer that D's first delta, queued before the loss, has since cleared (overdue too)
        if (event.node_id == att.prefill_id and att.first_token) or event.node_id not in (att.prefill_id, att.decode_id):
            return None
        return event.failure()
    node_id, msg = event
    if isinstance(msg, RequestFailed):     # P's after its first token too: its transfer to D broke (D aborted,
        return Failure(_at_fault(att, node_id, msg), f"{node_id}: {msg.reason}", msg.retryable)    # then a migration)
    if isinstance(msg, Busy) and node_id == att.prefill_id and not att.first_token:
        return Failure.prefill_busy(node_id, msg)
    if isinstance(msg, FirstToken) and node_id == att.prefill_id and not att.first_token:
        att.first_token = True
        choice.busy_prefills = BusyPrefills()   # a prefill node took it: a later Busy is a new wait
        if msg.prompt_logprobs is not None and request.prompt_logprobs is None:
            request.prompt_logprobs = _prompt_scores(msg.prompt_logprobs, request.prompt_ids, vocab)
        logprobs = None if msg.logprobs is None else (msg.logprobs,)
        merge(choice, att, 0, (msg.token_id,), 0, msg.text, logprobs, msg.finish_reason)
    elif isinstance(msg, TokenDelta) and node_id == att.decode_id:
        att.held.append(msg)
    if att.first_token:
        _merge_held(choice, att)
    return None


def _at_fault(att: Attempt, node_id: str, msg: RequestFailed) -> str:
    """The node a failure reported by node_id blames: a prefill node's failed transfer (or pairing),
    its decode node's (e.g. a Commit into its full queue), so that the next attempt avoids D, not P."""
    if node_id == att.prefill_id and att.decode_id and msg.reason.startswith((TRANSFER_FAILED, UNREACHABLE_DECODE)):
        return att.decode_id
    return node_id


def _prompt_scores(entries: tuple, prompt_ids: list[int], vocab: int) -> list[dict[int, float] | None] | None:
    """A prefill node's prompt logprobs, if they fit the prompt: one entry per token, the first
    None, each holding its own token's score, every id in the vocabulary; else None (logged)."""
    scores = [None if e is None else top_logprobs(e) for e in entries]
    fits = len(scores) == len(prompt_ids) and scores[0] is None and all(
        s is not None and token in s and all(t < vocab for t in s) for s, token in zip(scores[1:], prompt_ids[1:]))
    if not fits:
        log.warning("prompt logprobs that do not fit the prompt: ignored")
    return scores if fits else None


def _merge_held(choice: Choice, att: Attempt) -> None:
    """Merges every held delta that no longer leaves a gap, in any order they came."""
    progress = True
    while progress and att.held and choice.finish_reason is None:
        progress = False
        for delta in list(att.held):
            if merge(choice, att, delta.index, delta.token_ids, delta.text_offset, delta.text,
                     delta.logprobs, delta.finish_reason):
                att.held.remove(delta)
                att.decode_done = att.decode_done or bool(delta.finish_reason)
                progress = True


class TransferTimer:
    """P's first token to D's first delta, as the router receives them, once per attempt: the KV
    transfer, D's adoption of the blocks and its first decode step (0 if D's delta came first)."""

    def __init__(self, histogram: Any, clock=time.monotonic):
        self._histogram, self._clock = histogram, clock
        self._first_at: float | None = None     # P's FirstToken merged
        self._decode_at: float | None = None    # D's first TokenDelta received
        self._done = False

    def note(self, event: Any, att: Attempt) -> None:
        """After each event of the attempt's inbox has been applied (a local prefill ships nothing)."""
        if att.local:
            return
        now = self._clock()
        if self._first_at is None and att.first_token:
            self._first_at = now
        if self._decode_at is None and isinstance(event, tuple) and event[0] == att.decode_id \
                and isinstance(event[1], TokenDelta):
            self._decode_at = now
        if not self._done and self._first_at is not None and self._decode_at is not None:
            self._done = True
            self._histogram.observe(max(0.0, self._decode_at - self._first_at))


def check_control_size(request_id: str, prompt_ids: list[int], params: SamplingParams, block_size: int) -> None:
    """Raises ValueError if the request's PrefillRequest would be over the control plane's limit:
    a node could not read it (its socket drops what is larger), so it is refused up front."""
    blocks = -(-len(prompt_ids) // block_size)
    probe = PrefillRequest(request_id + "#000~000", tuple(prompt_ids), params, "tcp://" + "x" * 250, "x" * 64,
                           (MAX_BLOCK_ID,) * blocks, 0, 0)
    size = len(control.encode(probe))
    if size > control.MAX_CONTROL_BYTES:
        raise ValueError(f"the request is {size} bytes on the node network, over its "
                         f"{control.MAX_CONTROL_BYTES}-byte limit (fewer or shorter stop strings, or a shorter prompt)")
