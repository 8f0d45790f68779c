"""Engine logprobs ({token_id: logprob} per generated token) in the two OpenAI shapes."""
from __future__ import annotations

from typing import Any

from router.http.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """/v1/completions shape; top_logprobs keeps the sampled token too (up to n + 1 entries); a
    None entry (an echoed prompt's first token) has no logprob. Returns the logprobs and the text
    offset after the last token."""
    out = CompletionLogprobs()
    for token_id, top in zip(token_ids, logprobs):
        token = _text(tokenizer, token_id)
        out.tokens.append(token)
        out.token_logprobs.append(None if top is None else top[token_id])
        out.top_logprobs.append(None if top is None else {_text(tokenizer, t): lp for t, lp in _ranked(top)})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int) -> list[TokenLogprob]:
    """/v1/chat/completions shape: the sampled token, then the top_n most likely."""
    return [TokenLogprob(**_entry(tokenizer, token_id, top[token_id]).model_dump(),
                         top_logprobs=[_entry(tokenizer, t, lp) for t, lp in _ranked(top)[:top_n]])
            for token_id, top in zip(token_ids, logprobs)]


def _entry(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    token = _text(tokenizer, token_id)
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: (-item[1], item[0]))


def _text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])
