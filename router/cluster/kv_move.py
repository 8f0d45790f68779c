"""KV moves: a request decoding on a node an operator takes out (remove, drain deadline) moves to
another decode node with its KV blocks, so its continuation is exact in every dtype.

    attempt A on D1 (tokens o_1 .. o_n emitted)        node_operator: D1 draining, no new work
    1. start(D1): PauseRequest ─▶ D1 and MoveOut into the inbox of every attempt decoding on D1
       (the pause goes out at once: not when the attempt's stream reaches the MoveOut behind
       the deltas it has yet to merge, by when D1 may have finished the request)
    2. its last TokenDeltas merge as usual; Paused(n, chars before o_n)
    3. attempt A' = prompt + o_1 .. o_{n-1} (base n - 1: its first token o_n is the client's
       already), writer D1; DecodeRequest ─▶ D2 (one ask, admission.reserve_move) ─▶ Reserved
    4. ShipRequest(A', A) ─▶ D1: D1 ships its blocks into D2's reservation and commits o_n;
       D2 adopts them and streams A' from o_n on (merge skips what the client has)
    5. D2's first TokenDelta: A' no longer needs D1 (writer cleared); once no move off D1 is
       pending (and step 1 again finds nothing begun decoding there since), the operator
       removes D1 as before. D1 lost before that: D2 reports a transfer
       that broke (RequestFailed), so A' waits kv_move_timeout_s for D2's first delta or failure
  Any step failing or past kv_move_timeout_s (D1 not pausing, D2 Busy or full, D1 dead, the
  transfer failing) falls back to today's move: A, or A', ends and the next attempt re-prefills
  prompt + every emitted token. pdserve_router_migrations{cause, how} counts both kinds.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterator, NamedTuple

from pdwire.control import Paused, PauseRequest, ShipRequest, TokenDelta
from pdwire.messages import Reserved
from router.backend import NoNodeAvailable
from router.cluster.admission import Admission
from router.cluster.control_server import ControlServer
from router.cluster.disagg_request import Attempt, Choice, Failure, Lost, PendingRequest, apply_event
from router.cluster.membership import NodeLoss

log = logging.getLogger(__name__)
KV_MOVE, REPREFILL = "kv_move", "reprefill"     # the `how` of pdserve_router_migrations


class MoveOut(NamedTuple):
    """In an attempt's inbox: its decode node is being taken out; move the request with its blocks."""
    node_id: str
    loss: NodeLoss
    epoch: str = ""         # the node's incarnation when it was paused
    since: float = 0.0      # the loop's time then: the move's kv_move_timeout_s counts from it

    def failure(self, detail: str) -> Failure:
        """The fallback: a re-prefill move, counted under the loss's cause."""
        return Failure(self.node_id, f"node {self.node_id} {self.loss}: {detail}", True, self.loss.cause.value)


class _Untimed:
    """A histogram that keeps nothing: a KV move's attempt has no prefill to time the transfer from."""

    def observe(self, value: float) -> None:
        pass


UNTIMED = _Untimed()
NewAttempt = Callable[[PendingRequest, Choice, int, int], Attempt]   # (request, choice, emitted, text_base)


class KVMoves:
    def __init__(self, timeout_s: float, server: ControlServer, admission: Admission, attempts: dict[str, Attempt],
                 new_attempt: NewAttempt, end_attempt: Callable[[Attempt], None], migrations: Any, vocab: int):
        self._timeout_s, self._server, self._admission = timeout_s, server, admission
        self._attempts, self._new_attempt, self._end_attempt = attempts, new_attempt, end_attempt
        self._migrations, self._vocab = migrations, vocab
        self._moving: dict[str, set[Attempt]] = {}     # node -> attempts moving off it
        self._losses: dict[str, NodeLoss] = {}          # node -> why it is taken out
        self._wakeups: dict[str, asyncio.Event] = {}    # node -> set when one of its moves ends or lands

    def start(self, node_id: str, loss: NodeLoss) -> bool:
        """Step 1; False if nothing decodes on the node, nor is on its way to (or KV moves are off)."""
        if self._timeout_s <= 0:
            return False
        self._moving[node_id], self._losses[node_id] = set(), loss
        if self._pause_more(node_id) or self._coming(node_id):
            return True
        del self._moving[node_id], self._losses[node_id]
        return False

    def _pause_more(self, node_id: str) -> bool:
        """Step 1 for each attempt decoding on the node that is not moving off it yet: at start(),
        every one; later, one that began decoding there since (admitted before the drain, its
        blocks in after start()), which would otherwise be re-prefilled when the node goes."""
        moving = self._moving[node_id]
        atts = {a for a in self._on(node_id) if a.streaming and not a.decode_done and a not in moving}
        info, now = self._server.info(node_id), asyncio.get_running_loop().time()
        for att in atts:
            self._server.send(node_id, PauseRequest(att.wire_rid))
            att.inbox.put_nowait(MoveOut(node_id, self._losses[node_id], info.hello.epoch if info is not None else "",
                                         now))
        if atts:
            log.info("%s: moving %s with their KV blocks", node_id, ", ".join(sorted(a.wire_rid for a in atts)))
        moving |= atts
        return bool(atts)

    async def settled(self, node_id: str) -> None:
        """Returns once no move off the node is under way (pausing there, or its blocks not
        adopted yet), nothing more decodes there and nothing is on its way to: woken by each of
        its attempts ending, landing or beginning to decode (ended(), note()), no poll. The
        caller's bound (2 x kv_move_timeout_s) counts from the take-out's start: a late move may
        not finish within it, and then re-prefills."""
        try:
            while self._pending(node_id) or self._pause_more(node_id) or self._coming(node_id):
                wakeup = self._wakeups[node_id] = asyncio.Event()
                await wakeup.wait()
        finally:            # also when the caller's wait_for gave up: nothing stays behind for the node
            self._moving.pop(node_id, None)
            self._losses.pop(node_id, None)
            self._wakeups.pop(node_id, None)

    def ended(self, att: Attempt) -> None:
        """The attempt ended (the backend's end of an attempt): a move it was part of may be over."""
        self._wake(att)

    def _coming(self, node_id: str) -> bool:
        """Whether a request is on its way to decoding on the node: its first token sampled (by its
        prefill node, or the node's reservation for a prompt it prefills itself), its blocks not in
        yet; note() wakes the take-out at its first delta. (One still in admission may yet go
        elsewhere on a Busy: the node's loss retries it, no token lost.)"""
        return any(a.first_token and not a.streaming for a in self._on(node_id))

    def _on(self, node_id: str) -> Iterator[Attempt]:
        """The live attempts that decode, or will, on the node (not moves into it: a node taken
        out gets none)."""
        return (a for a in self._attempts.values() if a.decode_id == node_id and not a.ended and not a.writer)

    def _pending(self, node_id: str) -> bool:
        live = {a for a in self._moving[node_id] if not a.ended and node_id in (a.decode_id, a.writer)}
        self._moving[node_id] = live
        return bool(live)

    def _wake(self, att: Attempt) -> None:
        for node_id in [n for n, atts in self._moving.items() if att in atts or att.decode_id == n]:
            if (wakeup := self._wakeups.pop(node_id, None)) is not None:
                wakeup.set()

    def note(self, att: Attempt, event: Any) -> None:
        """Step 5, for each event of a streaming attempt: D2 took the blocks, D1 is done with. D1
        lost first: D2 reports a transfer that broke itself, so the attempt waits kv_move_timeout_s
        for D2's first delta or failure; then the loss, again and overdue, fails it."""
        if isinstance(event, Lost) and event.node_id == att.writer and not event.overdue:
            asyncio.get_running_loop().call_later(self._timeout_s, att.inbox.put_nowait, event._replace(overdue=True))
        elif (att.writer or not att.streaming) and isinstance(event, tuple) and event[0] == att.decode_id \
                and isinstance(event[1], TokenDelta):
            att.writer = ""         # (its booking went as the delta arrived: router/cluster/bookings.py)
            att.streaming = True
            self._wake(att)

    async def move(self, request: PendingRequest, choice: Choice, att: Attempt,
                   out: MoveOut) -> tuple[Attempt | None, Failure | None]:
        """Steps 2-4 for `att` (paused by start()): (the new attempt, its blocks on their way,
        None), or (None, the failure to re-prefill after), or (None, None) when the choice
        finished meanwhile."""
        paused = await self._paused(request, choice, att, out.since + self._timeout_s)
        if choice.finish_reason is not None or isinstance(paused, Failure):
            return None, paused
        if paused is None:
            return None, out.failure(f"not paused within {self._timeout_s:g} s")
        if not self._holds(out):        # lost after its Paused: its Lost waits behind it, unread
            return None, out.failure("lost after it paused")
        if paused.num_tokens == 0 or att.base + paused.num_tokens != len(choice.token_ids):
            return None, out.failure(f"{paused.num_tokens} tokens held of {len(choice.token_ids) - att.base}")
        if att.text_base + paused.text_chars > choice.out.length:     # the node's word, checked: no hang
            return None, out.failure(f"{paused.text_chars} characters before its last token, of "
                                     f"{choice.out.length - att.text_base}")
        moved = self._new_attempt(request, choice, len(choice.token_ids) - 1, att.text_base + paused.text_chars)
        moved.writer, moved.first_token = out.node_id, True     # the client has its first token
        if out.node_id in self._moving:         # not when the take-out gave up waiting already
            self._moving[out.node_id].add(moved)
        try:
            reply = await self._admission.reserve_move(choice, moved)
        except NoNodeAvailable as err:
            reply = Failure(out.node_id, str(err), True)
        endpoint = self._endpoint(moved.decode_id)
        held = self._holds(out)
        if not isinstance(reply, Reserved) or not endpoint or not held:
            self._end_attempt(moved)
            return None, out.failure(f"no reservation for its blocks ({_why(reply)})" if held else "lost after it paused")
        moved.contacted.add(out.node_id)
        if (booking := att.bookings.pop(out.node_id, None)) is not None:
            moved.bookings[out.node_id] = booking     # D1 is not idle until D2 has the blocks
        self._server.send(out.node_id, ShipRequest(moved.wire_rid, att.wire_rid, endpoint,
                                                   reply.xfer_id, reply.dst_block_ids, reply.cached_prefix_blocks))
        self._migrations.labels(out.loss.cause.value, KV_MOVE).inc()
        log.info("%s: moving with its KV blocks from %s to %s (as %s)", att.wire_rid, out.node_id,
                 moved.decode_id, moved.wire_rid)
        return moved, None

    async def _paused(self, request: PendingRequest, choice: Choice, att: Attempt,
                      deadline: float) -> Paused | Failure | None:
        """Step 2: the node's Paused, merging what comes before it; a Failure if the attempt
        failed meanwhile; None if the choice finished (or, not finished, the time ran out)."""
        loop = asyncio.get_running_loop()
        while choice.finish_reason is None:
            try:
                event = await asyncio.wait_for(att.inbox.get(), deadline - loop.time())
            except TimeoutError:
                return None
            if isinstance(event, MoveOut):
                continue
            if isinstance(event, tuple) and event[0] == att.decode_id and isinstance(event[1], Paused):
                return event[1]
            failure = apply_event(choice, att, event, request, self._vocab)
            if failure is not None:
                return failure
        return None

    def _holds(self, out: MoveOut) -> bool:
        """Whether the node that paused still holds the blocks: the same incarnation, still there
        (a node lost after its Paused would never be sent the ShipRequest: the new attempt would
        wait out the reservation's lease for a writer that is gone)."""
        info = self._server.info(out.node_id)
        return info is not None and info.hello.epoch == out.epoch

    def _endpoint(self, node_id: str) -> str:
        """The node's KV receiver ("" if the node is gone)."""
        info = self._server.info(node_id)
        return info.hello.kv_endpoint if info is not None else ""


def _why(reply: Any) -> str:
    if reply is None:
        return "no decode node with room"
    return getattr(reply, "reason", None) or type(reply).__name__
