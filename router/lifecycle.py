"""The life of one HTTP request in the backend.

1. the app tokenizes and validates; a Generation starts one backend request per prompt
   (`{id}-{i}`), each carrying all n choices
2. start() waits for every prompt's first output, so a rejection (ValueError) still becomes a 400
   before any response byte is sent
3. outputs() merges the prompts' outputs as they arrive, tagged with the prompt's index
4. close() (always, via `async with`) cancels what still runs: the backend generators' cleanup
   aborts every unfinished request, on error, client disconnect or normal end alike
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, NamedTuple, TypeVar

from fastapi import Request

from engine.sampling_params import SamplingParams
from router.backend import Backend
from router.metrics import RouterMetrics
from router.protocol import UsageInfo

T = TypeVar("T")
_DONE = object()    # a prompt's stream ended


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


class Generation:
    def __init__(self, backend: Backend, metrics: RouterMetrics, request_id: str,
                 prompts: list[tuple[list[int], SamplingParams]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._streams = [backend.generate(f"{request_id}-{i}", token_ids, params)
                         for i, (token_ids, params) in enumerate(prompts)]
        self._trackers = [metrics.tracker() for _ in prompts]
        self._tasks: list[asyncio.Task] = []
        self._ready: list[tuple[int, Any]] = []

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Waits for each prompt's first output. Raises the backend's ValueError on rejection."""
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        started: set[int] = set()
        while len(started) < len(self._streams):
            index, item = await self._next()
            started.add(index)
            self._ready.append((index, item))

    async def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, RequestOutput) until every prompt's stream has ended."""
        open_streams = len(self._streams)
        ready, self._ready = self._ready, []
        while open_streams:
            index, item = ready.pop(0) if ready else await self._next()
            if item is _DONE:
                open_streams -= 1
            else:
                yield index, item

    async def close(self) -> None:
        """Cancels and closes every backend stream (aborting the unfinished); idempotent."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream, tracker in zip(self._streams, self._trackers):
            await stream.aclose()
            tracker.fail("abort")   # a no-op for requests that finished

    async def _next(self) -> tuple[int, Any]:
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return index, item

    async def _pump(self, index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for output in stream:
                self._trackers[index].on_output(output)
                self._queue.put_nowait((index, output))
            self._queue.put_nowait((index, _DONE))
        except Exception as err:    # noqa: BLE001 -- handed to the consumer, which re-raises it
            self._trackers[index].fail("rejected" if isinstance(err, ValueError) else "error")
            self._queue.put_nowait((index, err))


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
    hold_chars: int = 0     # streaming: characters held back while a choice runs (longest stop - 1)


def usage(meta: ResponseMeta, finals: dict[int, Any]) -> UsageInfo:
    """Usage of the whole request from each prompt's last output."""
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    prompt = sum(meta.prompt_lens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
