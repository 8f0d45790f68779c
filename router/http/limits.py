"""Size limits at the HTTP edge, checked before any work: each a RouterConfig flag, each refused
with a 400 in OpenAI's shape that names the limit and its flag.

    body bytes, JSON values (its commas outside strings) ──▶ (parse) ──▶ n, stop strings,
               logit_bias, logprobs, prompt size, valid Unicode, grammar size
               ──▶ (tokenize and parse the grammar off the loop) ──▶ prompts x n x (logprobs + 1) x tokens scored
"""
from __future__ import annotations

import hmac
from typing import Any, Iterable

import numpy as np

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import RouterConfig
from router.http.errors import OpenAIError, admin_disabled, bad_request, error_body, invalid_api_key
from router.http.protocol import ChatCompletionRequest, CompletionRequest
from pdwire.structured_output import GrammarKind, StructuredOutput, json_depth


def over_limit(what: str, given: int, limit: int, flag: str, param: str | None) -> OpenAIError:
    return bad_request(f"{what}: {given} is over the limit of {limit} (--{flag.replace('_', '-')})", param)


def check_request(body: CompletionRequest | ChatCompletionRequest, config: RouterConfig) -> None:
    """Raises a 400 for a request over a size limit or with text that is not valid Unicode."""
    _at_most("n", body.n, config.max_n, "max_n", "n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    _at_most("number of stop strings", len(stops), config.max_stop_strings, "max_stop_strings", "stop")
    _at_most("longest stop string (characters)", max(map(len, stops), default=0), config.max_stop_chars,
             "max_stop_chars", "stop")
    _at_most("logit_bias entries", len(body.logit_bias or {}), config.max_logit_bias, "max_logit_bias",
             "logit_bias")
    if isinstance(body, CompletionRequest):
        _at_most("logprobs", body.logprobs or 0, config.max_logprobs, "max_logprobs", "logprobs")
        _check_prompt(body.prompt, config)
        texts = _strings(body.prompt)
    else:
        _at_most("top_logprobs", body.top_logprobs or 0, config.max_logprobs, "max_logprobs", "top_logprobs")
        texts = [m.template_dict()["content"] for m in body.messages]
        _at_most("prompt length (characters of all messages)", sum(map(len, texts)), config.max_prompt_chars,
                 "max_prompt_chars", "messages")
    _check_unicode(texts, "prompt" if isinstance(body, CompletionRequest) else "messages")
    _check_unicode(stops, "stop")


def check_grammar_size(spec: StructuredOutput | None, config: RouterConfig, param: str) -> None:
    """A 400 for a spec over --max-grammar-chars or --max-grammar-depth (before it is parsed)."""
    if spec is None:
        return
    _at_most(f"{spec.kind.value} (characters)", len(spec.spec), config.max_grammar_chars, "max_grammar_chars", param)
    if spec.kind is GrammarKind.JSON_SCHEMA:
        _at_most("json_schema (nesting depth)", json_depth(spec.spec), config.max_grammar_depth, "max_grammar_depth",
                 param)


def parse_grammar_spec(_tokenizer: Any, spec: StructuredOutput, param: str) -> None:
    """A 400 for a spec the grammar library cannot parse. Run off the event loop (Workers.run):
    a grammar of --max-grammar-chars parses for milliseconds to seconds."""
    from engine.grammar import parse_grammar      # the library loads with the first structured request
    try:
        parse_grammar(spec)
    except ValueError as err:
        raise bad_request(str(err), param) from err


def check_logprob_cells(prompt_lens: list[int], n: int, logprobs: int | None, echo: bool,
                        max_tokens: list[int], config: RouterConfig) -> None:
    """Raises a 400 if the request would score more than max_logprob_cells (token, candidate) pairs:
    each prompt's n choices x (logprobs + 1) x the tokens scored (its own, when echoed, + max_tokens)."""
    if logprobs is None:
        return
    cells = sum(n * (logprobs + 1) * ((length if echo else 0) + tokens)
                for length, tokens in zip(prompt_lens, max_tokens))
    _at_most("logprobs work (prompts x n x (logprobs + 1) x tokens)", cells, config.max_logprob_cells,
             "max_logprob_cells", "logprobs")


def _check_prompt(prompt: Any, config: RouterConfig) -> None:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        chars = sum(map(len, _strings(prompt)))
        _at_most("prompt length (characters)", chars, config.max_prompt_chars, "max_prompt_chars", "prompt")
    else:
        ids = sum(len(p) if isinstance(p, list) else 1 for p in prompt)
        _at_most("prompt length (token ids)", ids, config.max_prompt_token_ids, "max_prompt_token_ids", "prompt")


def _strings(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    return [p for p in prompt if isinstance(p, str)]


def _check_unicode(texts: Iterable[str], param: str) -> None:
    for text in texts:
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise bad_request(f"{param} is not valid Unicode (a lone surrogate at character "
                                  f"{err.start})", param) from err


def _at_most(what: str, given: int, limit: int, flag: str, param: str | None) -> None:
    if given > limit:
        raise over_limit(what, given, limit, flag, param)


class BodyLimit:
    """ASGI middleware: reads a request's body up to `max_bytes`, then hands it to the app. A body
    over the limit gets a 400 before it is read (by its Content-Length) or as soon as it grows past
    the limit (chunked bodies); the app never sees it. With an API key, a /v1 request without it
    gets its 401 here, from its headers, before any of its body is read; so does a /tokenize,
    /detokenize or /openapi.json request, and an /admin one without the admin key (a 403 if the
    router has none)."""

    def __init__(self, app: ASGIApp, max_bytes: int, api_key: str | None = None,
                 max_token_ids: int = RouterConfig.max_prompt_token_ids, admin_key: str | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self._max_values = max_token_ids + _OTHER_VALUES
        self._authorization = None if api_key is None else f"Bearer {api_key}".encode()
        self._admin = None if admin_key is None else f"Bearer {admin_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if (refused := self._unauthorized(scope["path"], headers.get(b"authorization", b""))) is not None:
            return await self._refuse(send, refused)      # from its headers: no body read
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, self._too_big(int(declared)))
        chunks, size, message = [], 0, {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return      # the client left while sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, self._too_big(size))
        body = b"".join(chunks)
        if body.count(b",") > self._max_values and (values := _json_values(body)) > self._max_values:
            return await self._refuse(send, over_limit("JSON values in the request body", values,
                                                       self._max_values, "max_prompt_token_ids", None))
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()
        await self.app(scope, replayed, send)

    def _unauthorized(self, path: str, given: bytes) -> OpenAIError | None:
        if path.startswith("/admin/"):
            if self._admin is None:
                return admin_disabled()
            return None if hmac.compare_digest(given, self._admin) else invalid_api_key()
        if self._authorization is None or not path.startswith(_API_KEYED):
            return None
        return None if hmac.compare_digest(given, self._authorization) else invalid_api_key()

    def _too_big(self, size: int) -> OpenAIError:
        return over_limit("request body (bytes)", size, self.max_bytes, "max_body_bytes", None)

    async def _refuse(self, send: Send, error: OpenAIError) -> None:
        from fastapi.responses import JSONResponse
        response = JSONResponse(error_body(error), status_code=error.status, headers={"Connection": "close"})
        await response({"type": "http"}, _no_receive, send)


_API_KEYED = ("/v1/", "/tokenize", "/detokenize", "/openapi.json")      # the routes behind the API key
_OTHER_VALUES = 1 << 16      # JSON values a request may hold besides its token ids (messages, stop...)


def _json_values(body: bytes) -> int:
    """About how many values the JSON text holds (its commas outside strings), in one vectorized
    pass: parsing and validating millions of them would hold the event loop for seconds."""
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    inside = np.bitwise_xor.accumulate(text == ord('"'))      # True within a string (and its opening quote)
    return int(np.count_nonzero((text == ord(",")) & ~inside))


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
