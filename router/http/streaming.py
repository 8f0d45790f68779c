"""Server-sent events, and the per-choice cursor that turns a backend's cumulative outputs into deltas."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One event: `data: {json}` and a blank line."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


class Delta(NamedTuple):
    """The unsent part of one choice."""
    index: int              # which of the prompt's n choices
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass(slots=True)
class ChoiceCursor:
    """How much of one choice's cumulative output has been sent.

    While a choice runs, its last `hold` characters are not sent (hold = the longest stop string
    less one, as vLLM does): they may be the start of a stop string, which the final text cuts.
    Whatever is sent is then a prefix of the final text:

        stop "\n\n", hold 1:   text "Hi\n"   sent "Hi"   ("\n" held)
                               text "Hi" (the next "\n" completed the stop)   sent "" + finish
    """
    chars: int = 0
    tokens: int = 0
    text_offset: int = 0    # completions logprobs: offset of the next token in the text
    done: bool = False
    hold: int = 0

    def advance(self, choice: Any) -> Delta | None:
        """The unsent part of `choice`, or None when there is nothing to send yet.

        Tokens whose text is still held back (a partial stop string or character) wait and go
        with the next text, so text and token_ids/logprobs stay aligned.
        """
        finished = choice.finish_reason is not None
        end = len(choice.text) if finished else max(self.chars, len(choice.text) - self.hold)
        text = choice.text[self.chars:end]
        if self.done or (not text and not finished):
            return None
        logprobs = None if choice.logprobs is None else choice.logprobs[self.tokens:]
        delta = Delta(choice.index, text, choice.token_ids[self.tokens:], logprobs, choice.finish_reason)
        self.chars, self.tokens = end, len(choice.token_ids)
        self.done = choice.finish_reason is not None
        return delta


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
