"""Colocated mode: prefill and decode on one node, the engine on its own thread in this process.

The engine is synchronous and not thread-safe, so only the engine thread touches it:

    event loop                          engine thread
    ----------                          -------------
    generate() ──_Add──▶ inbox ──▶ 1. drain the inbox: add_request / abort_request
                                   2. step() while work exists; a step that raises fails
                                      the requests it held (3 in a row: the engine is broken)
    asyncio.Queue per request ◀──── 3. each RequestOutput, cut into its delta (router/stop_hold.py),
                                      via loop.call_soon_threadsafe
                                   4. refresh the metrics snapshot; block on the inbox when idle

A structured output whose grammar is not compiled yet waits parked (engine/grammar_waits.py) while
its grammar compiles on a thread of its own: the engine thread serves the other requests, and
adds it once compiled. Too many compiles pending: a 503 (NoNodeAvailable), never a 400.

The engine's outputs are cumulative (its nodes' streamers need that); only their deltas leave the
engine thread. Beam search revises its beams until the end, so the engine outputs them once,
finished, and that one output goes whole.
"""
from __future__ import annotations

import asyncio
import copy
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from engine.grammar_jobs import GrammarBusy
from engine.grammar_waits import GrammarWaits
from pdwire.figures import PrefixCounters
from pdwire.outputs import RequestOutput
from pdwire.sampling_params import SamplingParams
from router.backend import Backend, NodeMetrics
from router.backend import NoNodeAvailable
from router.request_deltas import RequestDeltas
from router.stop_hold import StopHold

_END = object()     # sentinel: the request was aborted, its stream ends
_PARKED_POLL_S = 0.005  # while requests wait for their grammar: how often an idle engine thread looks


class _Sink:
    """The asyncio.Queue of one request, fed from the engine thread, and what its choices have
    not released yet (engine thread only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, params: SamplingParams):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.params = params
        self.holds: dict[int, StopHold] = {}
        self.sent = RequestDeltas(scored=params.prompt_logprobs is None)     # no scores due: none go
        self.prompt: list[int] | None = None            # the first output's prompt, shared by the rest

    def delta(self, output: RequestOutput) -> RequestOutput | None:
        """What `output` (cumulative) adds, or None if nothing. The prompt's scores, when asked for,
        come once, with or before the first choice delta."""
        if not self.sent.scored and output.prompt_logprobs is None and not output.finished:
            return None
        for whole in output.outputs:
            if whole.index not in self.holds:
                self.holds[whole.index] = StopHold(whole.index, self.params)
            self.holds[whole.index].advance_to(whole)
        delta = self.sent.take(self.holds.values(), output.prompt_logprobs, output.finished)
        if delta is None:
            return None
        self.prompt = output.prompt_token_ids if self.prompt is None else self.prompt
        return RequestOutput(output.request_id, self.prompt, delta.outputs, output.finished, delta.prompt_logprobs,
                             output.num_cached_tokens, output.queue_time)

    def push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:    # the loop is closed: nobody is listening any more
            pass


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: _Sink


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class ColocatedBackend(Backend):
    def __init__(self, engine: Any, node_id: str = "colocated"):
        self._engine = engine
        self._node_id = node_id
        # the engine thread detokenizes with engine.tokenizer; fast tokenizers must not be shared
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._model_name: str = engine.model_name
        self._max_model_len: int = engine.max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}      # engine thread only
        self._compiling: GrammarWaits[_Add] = GrammarWaits()       # engine thread only
        self._error: BaseException | None = None
        self._metrics = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy():
            raise NoNodeAvailable(f"engine is not running: {self._error!r}")
        sink = _Sink(asyncio.get_running_loop(), params)
        self._inbox.put(_Add(request_id, prompt, params, sink))
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is _END:
                    return
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def metrics(self) -> list[NodeMetrics]:
        return [self._metrics]

    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def close(self) -> bool:
        """Stop the engine thread, cancel the queued grammar compiles and kill the running ones
        (engine/grammar.py close); False if a compile thread still runs after a bounded wait: the
        process should then leave with os._exit (router/cli.py), not wait for it at interpreter exit."""
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join()
        grammars = self._engine.sampler.grammars
        return grammars is None or grammars.close()

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
        except BaseException as err:    # the engine is broken: fail every request, report unhealthy
            self._error = err
            for sink in self._sinks.values():
                sink.push(RuntimeError(f"engine failed: {err!r}"))
            self._sinks.clear()

    def _serve_once(self) -> bool:
        """One loop turn; False when asked to stop."""
        idle = not self._engine.has_unfinished_requests()
        for command in self._drain_inbox(block=idle, timeout=_PARKED_POLL_S if self._compiling else None):
            if isinstance(command, _Stop):
                return False
            self._apply(command)
        for _, command, error in self._compiling.settled():
            self._add(command, error)
        if self._engine.has_unfinished_requests():
            outputs, failed = self._engine.safe_step()        # a broken engine raises: see _run
            for rid, reason in failed.items():
                if (sink := self._sinks.pop(rid, None)) is not None:
                    sink.push(RuntimeError(reason))
            for output in outputs:
                self._deliver(output)
        self._metrics = self._snapshot()
        return True

    def _drain_inbox(self, block: bool, timeout: float | None) -> list:
        commands = []
        if block:
            try:
                commands.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            sink = self._sinks.pop(command.request_id, None)
            if sink is not None:
                self._compiling.drop(command.request_id)
                self._engine.abort_request(command.request_id)
                sink.push(_END)
            return
        if command.request_id in self._sinks:
            command.sink.push(ValueError(f"duplicate request id {command.request_id!r}"))
            return
        self._sinks[command.request_id] = command.sink
        try:
            job = None if command.params.structured is None else self._engine.grammar_job(command.params)
        except (GrammarBusy, ValueError) as err:
            return self._add(command, err)
        if job is not None and not job.done:
            return self._compiling.park(command.request_id, job, command)
        self._add(command, None)

    def _add(self, command: _Add, error: Exception | None) -> None:
        """Queue a request in the engine, or fail it with `error` (GrammarBusy: a 503)."""
        try:
            if error is not None:
                raise error
            self._engine.add_request(command.request_id, command.prompt, command.params)
        except GrammarBusy as err:
            self._fail(command, NoNodeAvailable(str(err)))
        except ValueError as err:
            self._fail(command, err)

    def _fail(self, command: _Add, err: Exception) -> None:
        self._sinks.pop(command.request_id, None)
        command.sink.push(err)

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if (delta := sink.delta(output)) is not None:
            sink.push(delta)
        if output.finished:
            del self._sinks[output.request_id]

    def _snapshot(self) -> NodeMetrics:
        m = self._engine.metrics()
        return NodeMetrics(self._node_id, "colocated", m.num_running, m.num_waiting, m.kv_usage,
                           m.prefix_hit_rate, m.num_preemptions, (),
                           PrefixCounters(m.prefix_queried_tokens, m.prefix_hit_tokens), m.block_size,
                           m.num_total_blocks)
