"""/v1/completions responses: the whole completion, or its SSE stream of `text_completion` chunks."""
from __future__ import annotations

from typing import Any, AsyncIterator

from router.lifecycle import Generation, ResponseMeta, usage
from router.logprobs import completion_logprobs
from router.protocol import CompletionChoice, CompletionResponse
from router.streaming import DONE, ChoiceCursor, sse


async def completion_response(meta: ResponseMeta, generation: Generation,
                              tokenizer: Any) -> CompletionResponse:
    finals: dict[int, Any] = {}
    async for index, output in generation.outputs():
        finals[index] = output
    choices = []
    for index, output in sorted(finals.items()):
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs, _ = completion_logprobs(tokenizer, c.token_ids, c.logprobs, 0)
            choices.append(CompletionChoice(index=index * meta.n + c.index, text=c.text,
                                            logprobs=logprobs, finish_reason=c.finish_reason or "abort"))
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                              choices=sorted(choices, key=lambda ch: ch.index), usage=usage(meta, finals))


async def completion_stream(meta: ResponseMeta, generation: Generation, tokenizer: Any,
                            include_usage: bool) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}
    cursors: dict[int, ChoiceCursor] = {}
    finals: dict[int, Any] = {}
    async for index, output in generation.outputs():
        finals[index] = output
        for c in output.outputs:
            choice_index = index * meta.n + c.index
            cursor = cursors.setdefault(choice_index, ChoiceCursor(hold=meta.hold_chars))
            delta = cursor.advance(c)
            if delta is None:
                continue
            logprobs = None
            if delta.logprobs is not None:
                logprobs, cursor.text_offset = completion_logprobs(
                    tokenizer, delta.token_ids, delta.logprobs, cursor.text_offset)
            choice = CompletionChoice(index=choice_index, text=delta.text, logprobs=logprobs,
                                      finish_reason=delta.finish_reason)
            yield sse(_chunk(meta, [choice]), exclude)
    if include_usage:
        yield sse(_chunk(meta, [], usage(meta, finals)))
    yield DONE


def _chunk(meta: ResponseMeta, choices: list[CompletionChoice], usage_info: Any = None) -> CompletionResponse:
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                              usage=usage_info)
