"""/v1/chat/completions responses: the whole answer, or its SSE stream of `chat.completion.chunk`s.

A stream opens with one `{"role": "assistant", "content": ""}` delta per choice, then content
deltas; a choice's last delta carries its finish_reason.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from router.lifecycle import Generation, ResponseMeta, usage
from router.logprobs import chat_logprobs
from router.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk,
                             ChatCompletionResponse, ChatStreamChoice, DeltaMessage)
from router.streaming import DONE, ChoiceCursor, sse


async def chat_response(meta: ResponseMeta, generation: Generation, tokenizer: Any,
                        top_logprobs: int) -> ChatCompletionResponse:
    finals: dict[int, Any] = {}
    async for index, output in generation.outputs():
        finals[index] = output
    choices = []
    for index, output in sorted(finals.items()):
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = ChatChoiceLogprobs(
                    content=chat_logprobs(tokenizer, c.token_ids, c.logprobs, top_logprobs))
            choices.append(ChatChoice(index=index * meta.n + c.index, message=AssistantMessage(content=c.text),
                                      logprobs=logprobs, finish_reason=c.finish_reason or "abort"))
    return ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                                  choices=sorted(choices, key=lambda ch: ch.index), usage=usage(meta, finals))


async def chat_stream(meta: ResponseMeta, generation: Generation, tokenizer: Any, top_logprobs: int,
                      include_usage: bool) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}
    num_choices = len(meta.prompt_lens) * meta.n
    for i in range(num_choices):
        opening = ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield sse(_chunk(meta, [opening]), exclude)
    cursors = [ChoiceCursor(hold=meta.hold_chars) for _ in range(num_choices)]
    finals: dict[int, Any] = {}
    async for index, output in generation.outputs():
        finals[index] = output
        for c in output.outputs:
            choice_index = index * meta.n + c.index
            delta = cursors[choice_index].advance(c)
            if delta is None:
                continue
            logprobs = None
            if delta.logprobs is not None:
                logprobs = ChatChoiceLogprobs(
                    content=chat_logprobs(tokenizer, delta.token_ids, delta.logprobs, top_logprobs))
            choice = ChatStreamChoice(index=choice_index, delta=DeltaMessage(content=delta.text),
                                      logprobs=logprobs, finish_reason=delta.finish_reason)
            yield sse(_chunk(meta, [choice]), exclude)
    if include_usage:
        yield sse(_chunk(meta, [], usage(meta, finals)))
    yield DONE


def _chunk(meta: ResponseMeta, choices: list[ChatStreamChoice], usage_info: Any = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                               usage=usage_info)
