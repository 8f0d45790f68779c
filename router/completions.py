"""/v1/completions responses: the whole completion, or its SSE stream of `text_completion` chunks."""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from engine.outputs import CompletionOutput, RequestOutput
from router.lifecycle import Generation, ResponseMeta, usage
from router.logprobs import completion_logprobs
from router.protocol import CompletionChoice, CompletionResponse
from router.streaming import DONE, ChoiceCursor, sse


async def completion_response(meta: ResponseMeta, generation: Generation, tokenizer: Any,
                              echo: list[str] | None = None, score_only: bool = False) -> CompletionResponse:
    """echo: each prompt's text, to start its choices with (and their logprobs, the prompt's).
    score_only (echo with max_tokens 0): the one token generated is not returned."""
    finals: dict[int, Any] = {}
    async for index, output in generation.outputs():
        finals[index] = _without_completion(output) if score_only else output
    choices = []
    for index, output in sorted(finals.items()):
        prefix = echo[index] if echo else ""
        ids, scores = _echoed(output) if echo else ([], [])    # the prompt's tokens come first
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs, _ = completion_logprobs(tokenizer, ids + c.token_ids, scores + c.logprobs, 0)
            choices.append(CompletionChoice(index=index * meta.n + c.index, text=prefix + c.text,
                                            logprobs=logprobs, finish_reason=c.finish_reason or "abort"))
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model,
                              choices=sorted(choices, key=lambda ch: ch.index), usage=usage(meta, finals))


async def completion_stream(meta: ResponseMeta, generation: Generation, tokenizer: Any, include_usage: bool,
                            echo: list[str] | None = None, score_only: bool = False) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}
    cursors: dict[int, ChoiceCursor] = {}
    finals: dict[int, Any] = {}
    async for index, output in generation.outputs():
        output = finals[index] = _without_completion(output) if score_only else output
        for c in output.outputs:
            choice_index = index * meta.n + c.index
            if choice_index not in cursors:
                if echo and c.logprobs is not None and output.prompt_logprobs is None and not output.finished:
                    continue        # its echo waits for the prompt's scores (one choice's prefill sends them)
                cursors[choice_index] = ChoiceCursor(hold=meta.hold_chars)
                if echo:            # the prompt goes first, in a chunk of its own
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs, cursors[choice_index].text_offset = completion_logprobs(
                            tokenizer, *_echoed(output), 0)
                    yield sse(_chunk(meta, [CompletionChoice(index=choice_index, text=echo[index],
                                                             logprobs=logprobs)]), exclude)
            cursor = cursors[choice_index]
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


def _without_completion(output: RequestOutput) -> RequestOutput:
    """The output with its choices emptied (ended "length" once it finishes): echo with
    max_tokens 0 runs one token, which nobody asked for."""
    empty = [CompletionOutput(c.index, "", [], None if c.logprobs is None else [],
                              "length" if c.finish_reason else None) for c in output.outputs]
    return dataclasses.replace(output, outputs=empty)


def _echoed(output: RequestOutput) -> tuple[list[int], list[dict[int, float] | None]]:
    """The prompt's tokens and their logprobs (None where the backend has none)."""
    ids = output.prompt_token_ids
    return list(ids), list(output.prompt_logprobs or [None] * len(ids))


def _chunk(meta: ResponseMeta, choices: list[CompletionChoice], usage_info: Any = None) -> CompletionResponse:
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                              usage=usage_info)
