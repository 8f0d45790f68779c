"""Endpoints clients probe beside /v1/*: one model's card, /tokenize, /detokenize, /version.

`keyed_routes()` sit behind the API key (the app mounts them with its key check), `open_routes()`
do not (as /health).
"""
from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Request

from router.http.errors import model_not_found
from router.http.limits import check_request, over_limit
from router.http.protocol import ModelCard
from router.http.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, detokenize,
                             tokenize)


def keyed_routes() -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> ModelCard:
        state = request.app.state
        if model_id != state.model_name:
            raise model_not_found(model_id)
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.backend.max_model_len)

    @routes.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state = request.app.state
        _check_model(body.model, state.model_name)
        check_request(body.as_generation_request(), state.config)
        ids = await state.workers.run(tokenize, body, state.config.trust_chat_control_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.backend.max_model_len, tokens=ids)

    @routes.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = request.app.state
        _check_model(body.model, state.model_name)
        limit = state.config.max_prompt_token_ids
        if len(body.tokens) > limit:
            raise over_limit("tokens", len(body.tokens), limit, "max_prompt_token_ids", "tokens")
        return DetokenizeResponse(prompt=await state.workers.run(detokenize, body.tokens))

    return routes


def open_routes() -> APIRouter:
    routes = APIRouter()

    @routes.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("pdserve")}

    return routes


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise model_not_found(requested)
