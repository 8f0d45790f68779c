"""/v1/chat/completions responses: the whole answer, or its SSE stream of `chat.completion.chunk`s.

A stream opens with one `{"role": "assistant", "content": ""}` delta per choice, then content
deltas; a choice's last delta carries its finish_reason. A whole answer is built and serialized on
a worker thread (`build_chat`), one choice at a time.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from router.http.lifecycle import Collected, Generation, ResponseMeta, usage, usage_so_far
from router.http.logprobs import chat_logprobs
from router.http.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk,
                             ChatCompletionResponse, ChatStreamChoice, DeltaMessage, StreamUsage)
from router.http.streaming import DONE, sse


def build_chat(tokenizer: Any, meta: ResponseMeta, collected: Collected, top_logprobs: int) -> bytes:
    """The whole answer as JSON bytes (runs on a worker thread)."""
    parts, generated = [], 0
    for index, full in sorted(collected.choices.items()):
        generated += len(full.token_ids)
        logprobs = None
        if full.logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(tokenizer, full.token_ids, full.logprobs,
                                                                top_logprobs))
        parts.append(ChatChoice(index=index, message=AssistantMessage(content=full.text), logprobs=logprobs,
                                finish_reason=full.finish_reason or "abort").model_dump_json())
    whole = ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[],
                                   usage=usage(meta, generated, collected.cached_tokens))
    return (whole.model_dump_json(exclude={"choices"})[:-1] + ',"choices":[' + ",".join(parts) + "]}").encode()


async def chat_stream(meta: ResponseMeta, generation: Generation, tokenizer: Any, top_logprobs: int,
                      usage_mode: StreamUsage) -> AsyncIterator[str]:
    exclude = None if usage_mode is not StreamUsage.NONE else {"usage"}
    generated = 0
    for i in range(len(meta.prompt_lens) * meta.n):
        opening = ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield sse(_chunk(meta, [opening], usage_so_far(meta, generated, generation, usage_mode)), exclude)
    async for out in generation.outputs():
        for d in out.choices:
            generated += len(d.token_ids)
            logprobs = None
            if d.logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(tokenizer, d.token_ids, d.logprobs, top_logprobs))
            choice = ChatStreamChoice(index=out.index * meta.n + d.index, delta=DeltaMessage(content=d.text),
                                      logprobs=logprobs, finish_reason=d.finish_reason)
            yield sse(_chunk(meta, [choice], usage_so_far(meta, generated, generation, usage_mode)), exclude)
    if usage_mode is not StreamUsage.NONE:
        yield sse(_chunk(meta, [], usage(meta, generated, generation.num_cached_tokens)))
    yield DONE


def _chunk(meta: ResponseMeta, choices: list[ChatStreamChoice], usage_info: Any = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                               usage=usage_info)
