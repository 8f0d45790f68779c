"""The operator API: /admin/* routes to list, drain and remove nodes (router/cluster/node_operator.py).

    GET  /admin/nodes                  {"object": "list", "data": [NodeView, ...]}
    POST /admin/nodes/{id}/drain       body {"deadline_s": 60} (optional): the node's NodeView
    POST /admin/nodes/{id}/remove      the node's NodeView, state "removed", once it is out: a
                                       decode node's KV moves are over first (at most
                                       2 x --kv-move-timeout-s); "drained" if its drain
                                       deadline had started taking it out already
    GET  /admin/pools                  {"object": "list", "data": [PoolView, ...]}: per role, the
                                       target and the active, draining and starting nodes
    POST /admin/pools/{role}           body {"count": N, "drain_deadline_s": 60}: the role's pool
                                       to N nodes (router/cluster/pool_scaler.py); its PoolView

Every route needs `Authorization: Bearer <admin_api_key>`, a key apart from the API key. With no
admin key configured they answer 403 on every host, loopback included: a reverse proxy or another
user on the same box reaches the router from loopback too, so the address proves nothing.
Errors are OpenAI's shape: 401 wrong key, 403 no admin key, 400 a backend without nodes
(colocated) or a refused scale, 404 an unknown node, 409 a router that starts no nodes itself.
"""
from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Callable, Literal

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from router.http.errors import OpenAIError, admin_disabled, invalid_api_key
from router.cluster.membership import DEFAULT_DRAIN_DEADLINE_S, NodeView
from router.cluster.pool_scaler import NoScaler, PoolView

if TYPE_CHECKING:
    from router.cluster.node_operator import NodeOperator

MAX_DRAIN_DEADLINE_S = 86_400.0
MAX_POOL_COUNT = 1024           # the body's bound; a deployment's own --max-pool-size is usually lower


class NodeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[NodeView]


class PoolList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PoolView]


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=0, le=MAX_POOL_COUNT)
    drain_deadline_s: float = Field(DEFAULT_DRAIN_DEADLINE_S, gt=0, le=MAX_DRAIN_DEADLINE_S)


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    deadline_s: float = Field(DEFAULT_DRAIN_DEADLINE_S, gt=0, le=MAX_DRAIN_DEADLINE_S)   # then its requests move


def operator_routes() -> APIRouter:
    routes = APIRouter(prefix="/admin", dependencies=[Depends(_check_admin_key)])

    @routes.get("/nodes")
    async def nodes(request: Request) -> NodeList:
        return NodeList(data=_operator(request).nodes())

    @routes.post("/nodes/{node_id}/drain")
    async def drain(node_id: str, request: Request, body: DrainRequest | None = Body(None)) -> NodeView:
        deadline_s = (body or DrainRequest()).deadline_s
        return _known(node_id, lambda: _operator(request).drain(node_id, deadline_s))

    @routes.post("/nodes/{node_id}/remove")
    async def remove(node_id: str, request: Request) -> NodeView:
        try:
            return await _operator(request).remove(node_id)
        except KeyError:
            raise _not_found(node_id) from None

    @routes.get("/pools")
    async def pools(request: Request) -> PoolList:
        return PoolList(data=_operator(request).pools())

    @routes.post("/pools/{role}")
    async def scale(role: str, body: ScaleRequest, request: Request) -> PoolView:
        try:
            return await _operator(request).scale(role, body.count, body.drain_deadline_s)
        except NoScaler as err:
            raise OpenAIError(409, str(err), type="invalid_request_error", code="no_scaler") from None
        except ValueError as err:
            raise OpenAIError(400, str(err), param="count", code="invalid_scale") from None

    return routes


async def _check_admin_key(request: Request) -> None:
    expected = request.app.state.config.admin_api_key
    if expected is None:
        raise admin_disabled()
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        raise invalid_api_key()


def _operator(request: Request) -> NodeOperator:
    operator = request.app.state.backend.operator
    if operator is None:
        raise OpenAIError(400, "this router has no nodes to manage (colocated mode)", code="no_nodes")
    return operator


def _known(node_id: str, act: Callable[[], NodeView]) -> NodeView:
    try:
        return act()
    except KeyError:
        raise _not_found(node_id) from None


def _not_found(node_id: str) -> OpenAIError:
    return OpenAIError(404, f"no node {node_id[:64]!r} is registered", type="not_found_error",
                       param="node_id", code="node_not_found")
