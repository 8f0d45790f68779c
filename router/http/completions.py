"""/v1/completions responses: the whole completion, or its SSE stream of `text_completion` chunks.

Echo with logprobs scores each prompt's tokens once and shares them among its n choices. A whole
response is built and serialized on a worker thread (`build_completion` there), one choice at a
time, so a large one never holds the event loop.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, NamedTuple

from pdwire.outputs import CompletionOutput
from router.http.lifecycle import Collected, FullChoice, Generation, ResponseMeta, usage, usage_so_far
from router.http.logprobs import completion_logprobs
from router.http.protocol import CompletionChoice, CompletionLogprobs, CompletionResponse, StreamUsage
from router.http.streaming import DONE, silent, sse
from router.http.workers import Workers


class Echo(NamedTuple):
    """What `echo` puts before each prompt's choices."""
    texts: list[str]                # each prompt as given, or its token ids decoded
    prompts: list[list[int]]        # each prompt's token ids (their logprobs come first)
    score_only: bool                # max_tokens 0: the one token generated is not returned


def build_completion(tokenizer: Any, meta: ResponseMeta, collected: Collected, echo: Echo | None) -> bytes:
    """The whole response as JSON bytes (runs on a worker thread)."""
    prompt_scores = {i: _prompt_logprobs(tokenizer, echo, collected, i) for i in range(len(meta.prompt_lens))} \
        if echo else {}
    parts, generated = [], 0
    for index, full in sorted(collected.choices.items()):
        prompt = index // meta.n
        generated += len(full.token_ids)
        full = _without_completion(full) if echo and echo.score_only else full
        logprobs = None
        if full.logprobs is not None:
            head, offset = prompt_scores.get(prompt) or (CompletionLogprobs(), 0)
            logprobs, _ = completion_logprobs(tokenizer, full.token_ids, full.logprobs, offset)
            logprobs = _joined(head, logprobs)
        text = (echo.texts[prompt] if echo else "") + full.text
        parts.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=full.finish_reason or "abort").model_dump_json())
    whole = CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=[],
                               usage=usage(meta, 0 if echo and echo.score_only else generated, collected.cached_tokens))
    return (whole.model_dump_json(exclude={"choices"})[:-1] + ',"choices":[' + ",".join(parts) + "]}").encode()


async def completion_stream(meta: ResponseMeta, generation: Generation, workers: Workers,
                            usage_mode: StreamUsage, echo: Echo | None = None) -> AsyncIterator[str]:
    exclude = None if usage_mode is not StreamUsage.NONE else {"usage"}
    started: set[int] = set()
    offsets: dict[int, int] = {}        # choice index -> text offset of its next token
    scores: dict[int, tuple[CompletionLogprobs, int]] = {}   # prompt index -> its echoed logprobs
    generated = 0
    async for out in generation.outputs():
        if echo and out.prompt_logprobs is not None:
            scores[out.index] = await workers.run(_score_prompt, echo, out.index, out.prompt_logprobs)
        for d in out.choices:
            index = out.index * meta.n + d.index
            generated += 0 if echo and echo.score_only else len(d.token_ids)
            d = _empty(d) if echo and echo.score_only else d
            so_far = usage_so_far(meta, generated, generation, usage_mode)
            if echo and index not in started:       # the prompt goes first, in a chunk of its own
                logprobs, offsets[index] = scores.get(out.index) or (None, 0)
                yield sse(_chunk(meta, [CompletionChoice(index=index, text=echo.texts[out.index],
                                                         logprobs=logprobs if d.logprobs is not None else None)],
                                 so_far), exclude)
            started.add(index)
            if silent(d):
                continue
            logprobs = None
            if d.logprobs is not None:
                logprobs, offsets[index] = completion_logprobs(workers.tokenizer, d.token_ids, d.logprobs,
                                                               offsets.get(index, 0))
            yield sse(_chunk(meta, [CompletionChoice(index=index, text=d.text, logprobs=logprobs,
                                                     finish_reason=d.finish_reason)], so_far), exclude)
    if usage_mode is not StreamUsage.NONE:
        yield sse(_chunk(meta, [], usage(meta, generated, generation.num_cached_tokens)))
    yield DONE


def _score_prompt(tokenizer: Any, echo: Echo, prompt: int, scores: list) -> tuple[CompletionLogprobs, int]:
    return completion_logprobs(tokenizer, echo.prompts[prompt], scores, 0)


def _prompt_logprobs(tokenizer: Any, echo: Echo, collected: Collected, prompt: int) -> tuple[CompletionLogprobs, int]:
    """The prompt's tokens and their logprobs (None where the backend has none), once per prompt."""
    ids = echo.prompts[prompt]
    return completion_logprobs(tokenizer, ids, collected.prompt_logprobs.get(prompt) or [None] * len(ids), 0)


def _joined(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=head.tokens + tail.tokens, token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + tail.text_offset)


def _without_completion(full: FullChoice) -> FullChoice:
    """Echo with max_tokens 0 runs one token, which nobody asked for: the choice is emptied and
    ends "length"."""
    return FullChoice([], [], None if full.logprobs is None else [], "length" if full.finish_reason else None)


def _empty(d: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(d.index, "", [], None if d.logprobs is None else [], "length" if d.finish_reason else None)


def _chunk(meta: ResponseMeta, choices: list[CompletionChoice], usage_info: Any = None) -> CompletionResponse:
    return CompletionResponse(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                              usage=usage_info)
