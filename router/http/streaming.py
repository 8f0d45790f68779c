"""Server-sent events, and the response that streams them."""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdwire.outputs import CompletionOutput

DONE = "data: [DONE]\n\n"


def silent(delta: CompletionOutput) -> bool:
    """A choice delta a stream sends no chunk for: tokens whose text is not out yet (the stop
    hold keeps it), no logprobs to show for them, and no finish."""
    return not delta.text and delta.finish_reason is None and (delta.logprobs is None or not delta.token_ids)


def sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One event: `data: {json}` and a blank line."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` when it ends, even when the body iterator
    never started (the client left first) or was cancelled on disconnect."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
