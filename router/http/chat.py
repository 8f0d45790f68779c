"""/v1/chat/completions responses: the whole answer, or its SSE stream of `chat.completion.chunk`s.

A stream opens with one `{"role": "assistant", "content": ""}` delta per choice, then content
deltas; a choice's last delta carries its finish_reason. A whole answer is built and serialized on
a worker thread (`build_chat`), one choice at a time.

With tools (router/http/tools.py) a choice's text is only known to be a call once it is whole, so
a stream holds it back and sends it in the choice's last delta: its content, if any, and its
`tool_calls` (index, id, type, function name and arguments), finish_reason "tool_calls".
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from router.http.lifecycle import Collected, Generation, ResponseMeta, usage, usage_so_far
from router.http.logprobs import chat_logprobs
from router.http.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk,
                             ChatCompletionResponse, ChatStreamChoice, DeltaMessage, StreamUsage)
from router.http.streaming import DONE, silent, sse
from router.http.tools import ToolMode, split_calls


def build_chat(tokenizer: Any, meta: ResponseMeta, collected: Collected, top_logprobs: int,
               tools: ToolMode | None = None) -> bytes:
    """The whole answer as JSON bytes (runs on a worker thread)."""
    parts, generated = [], 0
    for index, full in sorted(collected.choices.items()):
        generated += len(full.token_ids)
        logprobs = None
        if full.logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(tokenizer, full.token_ids, full.logprobs,
                                                                top_logprobs))
        content, calls = split_calls(full.text, tools) if tools is not None else (full.text, [])
        parts.append(ChatChoice(index=index, message=AssistantMessage(content=content, tool_calls=calls),
                                logprobs=logprobs, finish_reason=_finish(full.finish_reason, calls)).model_dump_json())
    whole = ChatCompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[],
                                   usage=usage(meta, generated, collected.cached_tokens))
    return (whole.model_dump_json(exclude={"choices"})[:-1] + ',"choices":[' + ",".join(parts) + "]}").encode()


async def chat_stream(meta: ResponseMeta, generation: Generation, tokenizer: Any, top_logprobs: int,
                      usage_mode: StreamUsage, tools: ToolMode | None = None) -> AsyncIterator[str]:
    exclude = None if usage_mode is not StreamUsage.NONE else {"usage"}
    generated = 0
    held: dict[int, list[str]] = {}     # with tools: choice index -> its text so far, in pieces
    for i in range(len(meta.prompt_lens) * meta.n):
        opening = ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield sse(_chunk(meta, [opening], usage_so_far(meta, generated, generation, usage_mode)), exclude)
    async for out in generation.outputs():
        for d in out.choices:
            generated += len(d.token_ids)
            if silent(d):
                continue
            logprobs = None
            if d.logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(tokenizer, d.token_ids, d.logprobs, top_logprobs))
            index = out.index * meta.n + d.index
            if tools is not None:
                held.setdefault(index, []).append(d.text)
                if d.finish_reason is None:
                    continue
                choice = _calls_choice(index, "".join(held.pop(index)), tools, d.finish_reason)
            else:
                choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=d.text), logprobs=logprobs,
                                          finish_reason=d.finish_reason)
            yield sse(_chunk(meta, [choice], usage_so_far(meta, generated, generation, usage_mode)), exclude)
    if usage_mode is not StreamUsage.NONE:
        yield sse(_chunk(meta, [], usage(meta, generated, generation.num_cached_tokens)))
    yield DONE


def _calls_choice(index: int, text: str, tools: ToolMode, finish_reason: str) -> ChatStreamChoice:
    """A tool-using choice's last delta: its content and its calls, whole."""
    content, calls = split_calls(text, tools)
    deltas = [{"index": i, **call.model_dump()} for i, call in enumerate(calls)]
    return ChatStreamChoice(index=index, delta=DeltaMessage(content=content, tool_calls=deltas or None),
                            finish_reason=_finish(finish_reason, calls))


def _finish(reason: str | None, calls: list) -> str:
    """A choice that ends with tool calls ends "tool_calls" (one cut by max_tokens stays "length")."""
    if calls and reason == "stop":
        return "tool_calls"
    return reason or "abort"


def _chunk(meta: ResponseMeta, choices: list[ChatStreamChoice], usage_info: Any = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                               usage=usage_info)
