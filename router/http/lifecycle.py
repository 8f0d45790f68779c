"""The life of one HTTP request in the backend.

1. the app tokenizes and validates; a Generation starts one backend request per prompt
   (`{id}-{i}`), each carrying all n choices
2. start() waits for every prompt's first output, so a rejection (ValueError) still becomes a 400
   before any response byte is sent
3. the backend yields deltas (router/backend.py: new text, tokens and logprobs only, stop
   strings already held back): what waits for the client is only output it has not been sent,
   at most max_stream_buffer_bytes of it; a client that falls further behind has its request
   ended (StreamBufferFull)
4. outputs() yields those deltas in arrival order, tagged with the prompt's index; a whole
   response collects them, a list of text pieces per choice joined once
5. close() (always) cancels what still runs: the backend generators' cleanup aborts every
   unfinished request, on error, client disconnect, shutdown or normal end alike
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, NamedTuple, TypeVar

from fastapi import Request

from pdwire.outputs import CompletionOutput
from pdwire.sampling_params import SamplingParams
from router.backend import Backend
from router.http.metrics import RouterMetrics
from router.http.protocol import PromptTokensDetails, StreamUsage, UsageInfo

T = TypeVar("T")
_DONE = object()    # a prompt's stream ended


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


class StreamBufferFull(RuntimeError):
    """The client fell more than max_stream_buffer_bytes behind its output."""


class ServerShuttingDown(RuntimeError):
    """The server's shutdown grace period ended while the request ran."""


class PromptDelta(NamedTuple):
    """What one backend output of one prompt added."""
    index: int                  # which prompt of the request
    choices: list[CompletionOutput]     # the choices that advanced, each its delta
    prompt_logprobs: list[dict[int, float] | None] | None   # the prompt's scores, once, when they come
    finished: bool


class Generation:
    def __init__(self, backend: Backend, metrics: RouterMetrics, request_id: str,
                 prompts: list[tuple[list[int], SamplingParams]], max_buffered_bytes: int):
        self._items: deque[tuple[int, Any]] = deque()
        self._wakeup = asyncio.Event()
        self._buffered = 0              # bytes of deltas not yet taken by the response
        self._max_buffered = max_buffered_bytes
        self._failure: BaseException | None = None    # ends the response at once (buffer full, shutdown)
        self._streams = [backend.generate(f"{request_id}-{i}", token_ids, params)
                         for i, (token_ids, params) in enumerate(prompts)]
        self._params = [params for _, params in prompts]
        self._trackers = [metrics.tracker() for _ in prompts]
        self._cached_tokens = [0] * len(prompts)      # each prompt's prefix-cache hit tokens
        self._tasks: list[asyncio.Task] = []
        self._ready: list[tuple[int, Any]] = []

    async def start(self) -> None:
        """Waits for each prompt's first output. Raises the backend's ValueError on rejection."""
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        started: set[int] = set()
        while len(started) < len(self._streams):
            index, item = await self._next()
            started.add(index)
            self._ready.append((index, item))

    async def outputs(self) -> AsyncIterator[PromptDelta]:
        """Each prompt's deltas until every prompt's stream has ended."""
        open_streams = len(self._streams)
        ready, self._ready = self._ready, []
        while open_streams:
            _, item = ready.pop(0) if ready else await self._next()
            if item is _DONE:
                open_streams -= 1
            else:
                yield item

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens of the request served from the prefix cache, as its backend reported them."""
        return sum(self._cached_tokens)

    def fail(self, err: BaseException) -> None:
        """Ends the response with `err` before any output still waiting; the requests stop."""
        if self._failure is None:
            self._failure = err
            self._items.clear()
            self._buffered = 0
            self._wakeup.set()
            for task in self._tasks:
                task.cancel()

    async def close(self) -> None:
        """Cancels and closes every backend stream (aborting the unfinished); idempotent."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream, tracker in zip(self._streams, self._trackers):
            await stream.aclose()
            tracker.fail("abort")   # a no-op for requests that finished

    async def _next(self) -> tuple[int, Any]:
        while not self._items and self._failure is None:
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._failure is not None:
            raise self._failure
        index, item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        self._buffered -= _size(item)
        return index, item

    def _put(self, index: int, item: Any) -> None:
        self._items.append((index, item))
        self._buffered += _size(item)
        self._wakeup.set()
        if self._buffered > self._max_buffered:
            self.fail(StreamBufferFull(f"the client fell more than {self._max_buffered} bytes behind its "
                                       "output (--max-stream-buffer-bytes); the request was ended"))

    async def _pump(self, index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for output in stream:
                self._trackers[index].on_output(output)
                self._cached_tokens[index] = max(self._cached_tokens[index], output.num_cached_tokens)
                if output.outputs or output.prompt_logprobs is not None:   # the scores come once (Backend)
                    self._put(index, PromptDelta(index, output.outputs, output.prompt_logprobs, output.finished))
            self._put(index, _DONE)
        except Exception as err:    # noqa: BLE001 -- handed to the consumer, which re-raises it
            self._trackers[index].fail("rejected" if isinstance(err, ValueError) else "error")
            self._put(index, err)


def _size(item: Any) -> int:
    """About how many bytes a delta holds: its text, its token ids, its logprob entries."""
    if not isinstance(item, PromptDelta):
        return 0
    size = 64 * len(item.prompt_logprobs or ())
    for d in item.choices:
        size += len(d.text) + 8 * len(d.token_ids) + 64 * sum(len(lp) for lp in d.logprobs or ())
    return size


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`, cancelling it (and so aborting its requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ResponseMeta(NamedTuple):
    """What every response object of one HTTP request repeats."""
    id: str
    created: int
    model: str
    n: int                  # choices per prompt: choice index = prompt index * n + output index
    prompt_lens: list[int]  # tokens of each prompt, for usage


@dataclass(slots=True)
class FullChoice:
    """One choice of a whole (non-streamed) response, put together from its deltas."""
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Collected(NamedTuple):
    choices: dict[int, FullChoice]      # by choice index (prompt index * n + output index)
    prompt_logprobs: dict[int, list]    # by prompt index, where the backend sent them
    cached_tokens: int = 0              # prompt tokens served from the prefix cache, all prompts


async def collect(generation: Generation, n: int) -> Collected:
    """Every delta of the request, put together per choice."""
    out = Collected({}, {})
    async for delta in generation.outputs():
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs[delta.index] = delta.prompt_logprobs
        for d in delta.choices:
            choice = out.choices.setdefault(delta.index * n + d.index, FullChoice())
            choice.texts.append(d.text)
            choice.token_ids += d.token_ids
            if d.logprobs is not None:
                choice.logprobs = [] if choice.logprobs is None else choice.logprobs
                choice.logprobs += d.logprobs
            choice.finish_reason = d.finish_reason or choice.finish_reason
    return out._replace(cached_tokens=generation.num_cached_tokens)


def usage(meta: ResponseMeta, completion: int, cached: int) -> UsageInfo:
    """Usage of the request, given the tokens generated for all its choices and the prompt tokens
    served from the prefix cache."""
    prompt = sum(meta.prompt_lens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def usage_so_far(meta: ResponseMeta, completion: int, generation: Generation, mode: StreamUsage) -> UsageInfo | None:
    """What a streamed chunk carries as usage: the usage so far when continuous, else nothing."""
    return usage(meta, completion, generation.num_cached_tokens) if mode is StreamUsage.CONTINUOUS else None
