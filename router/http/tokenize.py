"""/tokenize and /detokenize (vLLM's shapes): the request and response models, and the work they
do on a worker thread (router/http/workers.py passes the tokenizer first).

    {"prompt": "hi"} | {"messages": [...]}  ──▶  {"count": 2, "max_model_len": 4096, "tokens": [..]}
    {"tokens": [..]}                        ──▶  {"prompt": "hi"}
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.http.chat_template import render_chat
from router.http.errors import bad_request
from router.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

_REQUEST = ConfigDict(extra="ignore", strict=True)


class TokenizeRequest(BaseModel):
    """A completion prompt or a chat conversation; exactly one of them."""
    model_config = _REQUEST
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None      # None: True for a prompt, False for messages (vLLM's)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def as_generation_request(self) -> CompletionRequest | ChatCompletionRequest:
        """The same input as a generation request, so the same limits apply (router/http/limits.py)."""
        if self.messages is None:
            return CompletionRequest(prompt=self.prompt)
        return ChatCompletionRequest(messages=self.messages)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(tokenizer: Any, request: TokenizeRequest, trust_control_tokens: bool) -> list[int]:
    """The prompt's token ids, or the conversation's as chat completions would render it."""
    if request.messages is None:
        return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
    try:
        ids = render_chat(tokenizer, [m.template_dict() for m in request.messages], trust_control_tokens)
    except ValueError as err:
        raise bad_request(str(err), "messages") from err
    bos = getattr(tokenizer, "bos_token_id", None)
    if request.add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


def detokenize(tokenizer: Any, tokens: list[int]) -> str:
    """The text of `tokens`. Raises a 400 for an id outside the vocabulary."""
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in tokens):
        raise bad_request(f"tokens must be in [0, {vocab})", "tokens")
    return tokenizer.decode(tokens)
