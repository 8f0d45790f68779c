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
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from pdwire.sampling_params import SamplingParams
from pdwire.structured_output import StructuredOutput
from router.backend import Backend
from router.http.chat import build_chat, chat_stream
from router.http.completions import Echo, build_completion, completion_stream
from router.config import RouterConfig
from router.http.errors import (OpenAIError, error_body, from_value_error, install_error_handlers, internal,
                           invalid_api_key, model_not_found, unavailable)
from router.http.info_routes import keyed_routes, open_routes
from router.http.lifecycle import (ClientDisconnected, Collected, Generation, ResponseMeta, ServerShuttingDown,
                              StreamBufferFull, collect, unless_disconnected)
from router.http.limits import (BodyLimit, check_grammar_size, check_logprob_cells, check_request,
                                parse_grammar_spec)
from router.http.metrics import RouterMetrics
from router.http.operator import operator_routes
from router.backend import NoNodeAvailable
from router.http.prompts import chat_prompt, completion_prompts, echo_texts, max_tokens_for
from router.http.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from router.http.streaming import DONE, ClosingStreamingResponse, sse
from router.http.workers import Workers

_CLIENT_CLOSED = 499    # nginx's code for "client closed the request"; nobody reads it
_Params = list[tuple[list[int], SamplingParams]]


def create_app(backend: Backend, config: RouterConfig = RouterConfig()) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.state.backend = backend
    app.state.config = config
    app.state.metrics = RouterMetrics(backend)
    app.state.model_name = config.served_model_name or backend.model_name
    app.state.created = int(time.time())
    app.state.workers = Workers(backend.tokenizer, config.tokenizer_workers)
    app.state.generations = set()       # every running Generation, for end_all_streams()
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, api_key=config.api_key,
                       max_token_ids=config.max_prompt_token_ids, admin_key=config.admin_api_key)
    app.include_router(_ops_routes())
    app.include_router(operator_routes())      # /admin/*: its own key (config.admin_api_key)
    app.include_router(_v1_routes(), dependencies=[Depends(_check_api_key)])
    app.include_router(keyed_routes(), dependencies=[Depends(_check_api_key)])
    app.include_router(open_routes())
    return app


def end_all_streams(app: FastAPI, reason: str) -> int:
    """Ends every running request with a 503 / an error event (shutdown); returns how many."""
    generations = list(app.state.generations)
    for generation in generations:
        generation.fail(ServerShuttingDown(reason))
    return len(generations)


def _ops_routes() -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health(request: Request) -> Response:
        healthy = request.app.state.backend.is_healthy()
        return Response(status_code=200 if healthy else 503)

    @routes.get("/metrics")
    async def metrics(request: Request) -> Response:
        _check_keys(request, request.app.state.config.metrics_keys())
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
        check_request(body, state.config)
        prompts = await state.workers.run(completion_prompts, body, large=_is_large(request))
        echo = Echo(await state.workers.run(echo_texts, body, prompts), prompts,
                    body.requested_max_tokens() == 0) if body.echo else None
        prompt_logprobs = body.logprobs if body.echo else None
        structured = await _structured(body, state)
        params = _params(body, prompts, state, body.logprobs, prompt_logprobs, 1 if echo and echo.score_only else None,
                         structured)
        check_logprob_cells([len(p) for p in prompts], body.n, body.logprobs, body.echo,
                            [_room(p, state) for p in params], state.config)
        return await _serve(request, body, params,
                            lambda meta, got: state.workers.run(build_completion, meta, got, echo),
                            lambda meta, gen: completion_stream(meta, gen, state.workers, body.stream_usage, echo),
                            "cmpl")

    @routes.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state = request.app.state
        _check_model(body.model, state.model_name)
        check_request(body, state.config)
        tools = _valid(body, body.tool_mode)
        structured = await _structured(body, state)
        prompts = [await state.workers.run(chat_prompt, body, state.config.trust_chat_control_tokens, tools,
                                           large=_is_large(request))]
        top = body.top_logprobs or 0
        logprobs = _valid(body, body.logprobs_count)
        params = _params(body, prompts, state, logprobs, structured=structured)
        check_logprob_cells([len(prompts[0])], body.n, logprobs, False, [_room(p, state) for p in params],
                            state.config)
        return await _serve(request, body, params,
                            lambda meta, got: state.workers.run(build_chat, meta, got, top, tools),
                            lambda meta, gen: chat_stream(meta, gen, state.workers.tokenizer, top,
                                                          body.stream_usage, tools), "chatcmpl")

    return routes


async def _check_api_key(request: Request) -> None:
    api_key = request.app.state.config.api_key
    _check_keys(request, () if api_key is None else (api_key,))


def _check_keys(request: Request, accepted: tuple[str, ...]) -> None:
    """A 401 unless the request bears one of the accepted keys; none accepted: open."""
    if not accepted:
        return
    given = request.headers.get("authorization", "").encode()
    matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in accepted]   # every key compared
    if not any(matches):
        raise invalid_api_key()


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise model_not_found(requested)


def _is_large(request: Request) -> bool:
    """A body of a megabyte or more: its tokenization's memory is given back at once."""
    return int(request.headers.get("content-length", "0") or 0) >= 1 << 20


def _room(prompt: tuple[list[int], SamplingParams], state: Any) -> int:
    """The most tokens the prompt's choices may generate."""
    token_ids, params = prompt
    return params.max_tokens if params.max_tokens is not None else state.backend.max_model_len - len(token_ids)


async def _structured(body: CompletionRequest | ChatCompletionRequest, state: Any) -> StructuredOutput | None:
    """The request's structured output, checked: its size on the loop, then parsed by the grammar
    library on a worker thread (a large grammar's parse holds no other request); a 400 if not."""
    spec = _valid(body, body.structured_output)
    uses_tools = isinstance(body, ChatCompletionRequest) and body.tools and body.tool_choice != "none"
    param = "tools" if uses_tools else "response_format"
    check_grammar_size(spec, state.config, param)
    if spec is not None:
        await state.workers.run(parse_grammar_spec, spec, param)
    return spec


def _params(body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], state: Any,
            logprobs: int | None, prompt_logprobs: int | None = None, max_tokens: int | None = None,
            structured: StructuredOutput | None = None) -> _Params:
    """Each prompt with its SamplingParams (max_tokens depends on the prompt's length, unless given)."""
    default = state.config.default_max_tokens if isinstance(body, CompletionRequest) else None
    requested = body.requested_max_tokens() if max_tokens is None else max_tokens
    out = []
    for token_ids in prompts:
        limit = max_tokens_for(len(token_ids), requested, default, state.backend.max_model_len)
        out.append((token_ids, _valid(body, lambda: body.sampling_params(limit, logprobs, prompt_logprobs,
                                                                          structured))))
    return out


def _valid(body: Any, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except ValueError as err:
        raise from_value_error(err, set(type(body).model_fields)) from err


async def _serve(request: Request, body: Any, prompts: _Params, whole: Callable[[ResponseMeta, Collected],
                 Awaitable[bytes]], stream: Callable, prefix: str) -> Response:
    state = request.app.state
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    meta = ResponseMeta(request_id, int(time.time()), state.model_name, body.n,
                        [len(token_ids) for token_ids, _ in prompts])
    generation = Generation(state.backend, state.metrics, request_id, prompts, state.config.max_stream_buffer_bytes)
    state.generations.add(generation)
    streaming = False
    try:
        await unless_disconnected(request, generation.start())
        if body.stream:
            streaming = True
            return ClosingStreamingResponse(_guarded(stream(meta, generation)),
                                            lambda: _close(state, generation))
        collected = await unless_disconnected(request, collect(generation, meta.n))
        return Response(await whole(meta, collected), media_type="application/json")
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED)
    except (ValueError, NoNodeAvailable, RuntimeError) as err:
        raise _as_openai_error(err, body) from err
    finally:
        if not streaming:   # a stream closes its generation when the response ends
            await _close(state, generation)


async def _close(state: Any, generation: Generation) -> None:
    state.generations.discard(generation)
    await generation.close()


def _as_openai_error(err: Exception, body: Any = None) -> OpenAIError:
    if isinstance(err, ValueError):
        return from_value_error(err, set(type(body).model_fields) if body is not None else set())
    if isinstance(err, (NoNodeAvailable, ServerShuttingDown)):
        return unavailable(str(err))
    if isinstance(err, StreamBufferFull):
        return OpenAIError(400, str(err), code="stream_buffer_full")
    return internal(str(err))


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends a stream that fails midway with an error event and [DONE], as OpenAI servers do."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as err:    # noqa: BLE001 -- the status line is already sent
        yield sse(error_body(_as_openai_error(err)))
        yield DONE
