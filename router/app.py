"""The OpenAI-compatible HTTP front end: `create_app(backend, config)`.

A request's path through the app:
1. auth (Bearer key on /v1/*), body parsed into a protocol model (bad body: 400)
2. model name checked (404), prompt tokenized and checked against the context, SamplingParams
   built (bad values: 400)
3. a Generation is started in the backend; a rejection still answers 400; a client that leaves
   while waiting aborts it
4. the answer: one JSON body, or an SSE stream ending in `data: [DONE]`; closing the stream
   (normally, on error or on disconnect) aborts whatever is unfinished
"""
from __future__ import annotations

import hmac
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import SamplingParams
from router.backend import Backend
from router.chat import chat_response, chat_stream
from router.completions import completion_response, completion_stream
from router.config import RouterConfig
from router.errors import (OpenAIError, error_body, from_value_error, install_error_handlers,
                           invalid_api_key, model_not_found, unavailable)
from router.lifecycle import ClientDisconnected, Generation, ResponseMeta, unless_disconnected
from router.metrics import RouterMetrics
from router.policy import NoNodeAvailable
from router.prompts import chat_prompt, completion_prompts, echo_texts, max_tokens_for
from router.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from router.streaming import DONE, ClosingStreamingResponse, sse

_CLIENT_CLOSED = 499    # nginx's code for "client closed the request"; nobody reads it


def create_app(backend: Backend, config: RouterConfig = RouterConfig()) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.state.backend = backend
    app.state.config = config
    app.state.metrics = RouterMetrics(backend)
    app.state.model_name = config.served_model_name or backend.model_name
    app.state.created = int(time.time())
    install_error_handlers(app)
    app.include_router(_ops_routes())
    app.include_router(_v1_routes(), dependencies=[Depends(_check_api_key)])
    return app


def _ops_routes() -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health(request: Request) -> Response:
        healthy = request.app.state.backend.is_healthy()
        return Response(status_code=200 if healthy else 503)

    @routes.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    return routes


def _v1_routes() -> APIRouter:
    routes = APIRouter(prefix="/v1")

    @routes.get("/models")
    async def models(request: Request) -> ModelList:
        state = request.app.state
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                         max_model_len=state.backend.max_model_len)])

    @routes.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state = request.app.state
        _check_model(body.model, state.model_name)
        prompts = completion_prompts(body, state.backend.tokenizer)
        echo = echo_texts(body, prompts, state.backend.tokenizer) if body.echo else None
        prompt_logprobs = body.logprobs if body.echo else None
        score_only = body.echo and body.requested_max_tokens() == 0     # the prompt's logprobs alone
        params = _params(body, prompts, state, body.logprobs, prompt_logprobs, 1 if score_only else None)
        return await _serve(request, body, params,
                            lambda meta, gen: completion_response(meta, gen, state.backend.tokenizer, echo,
                                                                  score_only),
                            lambda meta, gen: completion_stream(meta, gen, state.backend.tokenizer,
                                                                body.include_usage, echo, score_only), "cmpl")

    @routes.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state = request.app.state
        _check_model(body.model, state.model_name)
        prompts = [chat_prompt(body, state.backend.tokenizer)]
        top = body.top_logprobs or 0
        logprobs = _valid(body, body.logprobs_count)
        return await _serve(request, body, _params(body, prompts, state, logprobs),
                            lambda meta, gen: chat_response(meta, gen, state.backend.tokenizer, top),
                            lambda meta, gen: chat_stream(meta, gen, state.backend.tokenizer, top,
                                                          body.include_usage), "chatcmpl")

    return routes


async def _check_api_key(request: Request) -> None:
    expected = request.app.state.config.api_key
    if expected is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        raise invalid_api_key()


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise model_not_found(requested)


def _params(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], state: Any,
            logprobs: int | None, prompt_logprobs: int | None = None,
            max_tokens: int | None = None) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt with its SamplingParams (max_tokens depends on the prompt's length, unless given)."""
    default = state.config.default_max_tokens if isinstance(body, CompletionRequest) else None
    requested = body.requested_max_tokens() if max_tokens is None else max_tokens
    out = []
    for token_ids in prompts:
        limit = max_tokens_for(len(token_ids), requested, default, state.backend.max_model_len)
        out.append((token_ids, _valid(body, lambda: body.sampling_params(limit, logprobs, prompt_logprobs))))
    return out


def _valid(body: Any, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except ValueError as err:
        raise from_value_error(err, set(type(body).model_fields)) from err


async def _serve(request: Request, body: Any, prompts: list[tuple[list[int], SamplingParams]],
                 whole: Callable, stream: Callable, prefix: str) -> Response:
    state = request.app.state
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    hold = max((len(s) for _, params in prompts for s in params.stop), default=1) - 1
    meta = ResponseMeta(request_id, int(time.time()), state.model_name, body.n,
                        [len(token_ids) for token_ids, _ in prompts], hold)
    generation = Generation(state.backend, state.metrics, request_id, prompts)
    streaming = False
    try:
        await unless_disconnected(request, generation.start())
        if body.stream:
            streaming = True
            return ClosingStreamingResponse(_guarded(stream(meta, generation)), generation.close)
        answer = await unless_disconnected(request, whole(meta, generation))
        return JSONResponse(answer.model_dump())
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)
    except (ValueError, NoNodeAvailable, RuntimeError) as err:
        raise _as_openai_error(err, body) from err
    finally:
        if not streaming:   # a stream closes its generation when the response ends
            await generation.close()


def _as_openai_error(err: Exception, body: Any) -> OpenAIError:
    if isinstance(err, ValueError):
        return from_value_error(err, set(type(body).model_fields))
    if isinstance(err, NoNodeAvailable):
        return unavailable(str(err))
    return OpenAIError(500, str(err), type="internal_error")


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends a stream that fails midway with an error event and [DONE], as OpenAI servers do."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as err:    # noqa: BLE001 -- the status line is already sent
        yield sse(error_body(OpenAIError(500, str(err), type="internal_error")))
        yield DONE
