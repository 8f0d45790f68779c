"""The operator API (/admin/*: list, drain, remove nodes) and the membership metrics, over a real
DisaggregatedBackend with scripted nodes (tests/disagg_harness.py) and the app on the same loop."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, NamedTuple

import httpx
import pytest

from pdwire.control import (AbortRequest, DecodeRequest, FirstToken, NodeGoodbye, Paused, PauseRequest,
                            PrefillRequest, TokenDelta)
from pdwire.messages import Reserved
from router.cluster.membership import LossCause, NodeLoss
from router.http.app import create_app
from router.config import RouterConfig
from router.http.metrics import RouterMetrics
from tests.disagg_harness import LOSSY, PROMPT, END, Cluster, Consumer, ScriptedNode, first_of, run, until, view
from tests.fake_backend import FakeBackend
from tests.http_helpers import error_of

ADMIN, API = "admin-key-0123456789", "api-key-0123456789"
APP_CONFIG = RouterConfig(api_key=API, admin_api_key=ADMIN)


def admin_client(backend, config: RouterConfig = APP_CONFIG, key: str | None = ADMIN) -> httpx.AsyncClient:
    """The app on this loop (the backend's), with the admin key unless told otherwise."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(backend, config)),
                             base_url="http://router", headers=headers)


def membership(backend) -> dict[str, float]:
    """Every pdserve_router_* membership, retry and migration sample on /metrics."""
    text = RouterMetrics(backend).render().decode()
    names = ("pdserve_router_node", "pdserve_router_retries_total", "pdserve_router_migrations_total")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(names) and "_created" not in line}


def counts(joins: int, active: tuple[int, int], goodbyes: int = 0, drains: int = 0, removals: int = 0,
           draining: tuple[int, int] = (0, 0), extra: dict[str, float] | None = None) -> dict[str, float]:
    """The expected membership samples; active/draining are (prefill, decode) node counts."""
    out = {"pdserve_router_node_joins_total": joins, "pdserve_router_node_goodbyes_total": goodbyes,
           "pdserve_router_node_drains_total": drains, "pdserve_router_node_removals_total": removals}
    for i, role in enumerate(("prefill", "decode")):
        out[f'pdserve_router_nodes{{role="{role}",state="active"}}'] = active[i]
        out[f'pdserve_router_nodes{{role="{role}",state="draining"}}'] = draining[i]
    return {**out, **(extra or {})}


async def cast(c: Cluster) -> tuple[ScriptedNode, list[ScriptedNode]]:
    p = await c.node("prefill-0", "prefill")
    return p, [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]


async def first_tokens(p: ScriptedNode, ds: list[ScriptedNode], out) -> tuple[ScriptedNode, ScriptedNode]:
    """Admits r1 on whichever decode node it picks; P's token 11 and D's token 12 reach the client.
    Returns (that node, the other)."""
    d, _ = await first_of(ds, DecodeRequest)
    d.send(Reserved("r1", "x1", (3, 4), 0))
    await p.expect(PrefillRequest)
    p.send(FirstToken("r1", 11, "a", None, ""))
    assert view(await out.next()) == ([([11], "a", None)], False)
    d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, ""))
    assert view(await out.next()) == ([([11, 12], "ab", None)], False)
    return d, ds[1 - ds.index(d)]


class MidStream(NamedTuple):
    c: Cluster
    p: ScriptedNode
    d: ScriptedNode             # r1's decode node
    other: ScriptedNode         # the other decode node
    out: Consumer               # r1's stream
    http: httpx.AsyncClient     # the admin client


@contextlib.asynccontextmanager
async def mid_stream(max_tokens: int) -> AsyncIterator[MidStream]:
    """A cluster of prefill-0 and two decode nodes with r1 (max_tokens) past its first two tokens
    (first_tokens), and the admin client."""
    async with Cluster() as c:
        p, ds = await cast(c)
        out = c.generate(max_tokens=max_tokens)
        d, other = await first_tokens(p, ds, out)
        async with admin_client(c.backend) as http:
            yield MidStream(c, p, d, other, out, http)


async def removed_mid_stream(c: Cluster, p: ScriptedNode, ds: list[ScriptedNode], out) -> tuple[ScriptedNode, ScriptedNode]:
    """first_tokens, then the operator removes r1's decode node, which is asked to pause r1.
    Returns (that node, the other)."""
    d1, live = await first_tokens(p, ds, out)
    c.remove(d1.node_id)                    # answers once r1 has moved
    assert (await d1.expect(PauseRequest)).rid == "r1"
    return d1, live


# ------------------------------------------------------------------ listing


def test_nodes_lists_role_state_load_epoch_address_and_heartbeat_age():
    """GET /admin/nodes: each registered node by id, with its last heartbeat's load and its address."""
    async def test():
        async with Cluster() as c:
            p, ds = await cast(c)
            ds[1].kv_usage, ds[1].free_blocks, ds[1].num_running = 0.5, 32, 3
            await until(lambda: c.backend.server.info("decode-1").status.num_free_blocks == 32)
            async with admin_client(c.backend) as http:
                reply = await http.get("/admin/nodes")
            assert reply.status_code == 200
            body = reply.json()
            ages = [n.pop("last_heartbeat_age_s") for n in body["data"]]
            assert all(0 <= age < c.backend.server.registry._timeout for age in ages)
            base = {"state": "active", "epoch": "e1", "num_waiting": 0, "num_blocks": 64, "booked_requests": 0,
                    "drain_deadline_s": None}
            assert body == {"object": "list", "data": [
                {**base, "id": "decode-0", "role": "decode", "address": ds[0].kv_endpoint, "num_running": 1,
                 "kv_usage": 0.0, "num_free_blocks": 64},
                {**base, "id": "decode-1", "role": "decode", "address": ds[1].kv_endpoint, "num_running": 3,
                 "kv_usage": 0.5, "num_free_blocks": 32},
                {**base, "id": "prefill-0", "role": "prefill", "address": "", "num_running": 1,
                 "kv_usage": 0.0, "num_free_blocks": 64}]}
            assert membership(c.backend) == counts(3, (1, 2))
    run(test)


# ------------------------------------------------------------------ the admin key


def test_admin_routes_answer_403_without_an_admin_key_configured():
    """No admin_api_key: every /admin route is 403, whatever key the client sends (the API key too)."""
    async def test():
        async with Cluster() as c:
            await cast(c)
            async with admin_client(c.backend, RouterConfig(api_key=API), key=API) as http:
                replies = [await http.get("/admin/nodes"), await http.post("/admin/nodes/decode-0/drain"),
                           await http.post("/admin/nodes/decode-0/remove")]
            for reply in replies:
                assert error_of(reply, 403)["code"] == "admin_disabled"
            assert [n.state.value for n in c.backend.server.registry.nodes()] == ["active"] * 3
    run(test)


@pytest.mark.parametrize("key", [None, API, "wrong"])
def test_admin_routes_need_the_admin_key_not_the_api_key(key):
    """With an admin key set, no key, the API key or a wrong key get 401 and change nothing."""
    async def test():
        async with Cluster() as c:
            await cast(c)
            async with admin_client(c.backend, key=key) as http:
                listed = await http.get("/admin/nodes")
                drained = await http.post("/admin/nodes/decode-0/drain")
            assert error_of(listed, 401)["code"] == error_of(drained, 401)["code"] == "invalid_api_key"
            assert c.backend.server.count(c.backend.server.registry.get("decode-0").role) == 2
    run(test)


def test_the_admin_key_must_differ_from_the_api_key():
    """RouterConfig refuses an admin key equal to the API key."""
    with pytest.raises(ValueError, match="admin_api_key must differ from api_key"):
        RouterConfig(api_key="k" * 16, admin_api_key="k" * 16)


def test_colocated_backend_answers_400_and_an_unknown_node_404():
    """A backend without nodes answers 400 no_nodes; a node id nobody registered, 404 node_not_found;
    a bad drain body, 400."""
    async def test():
        async with admin_client(FakeBackend()) as http:
            for reply in (await http.get("/admin/nodes"), await http.post("/admin/nodes/x/remove")):
                assert error_of(reply, 400)["code"] == "no_nodes"
        async with Cluster() as c:
            await cast(c)
            async with admin_client(c.backend) as http:
                for path in ("/admin/nodes/decode-9/drain", "/admin/nodes/decode-9/remove"):
                    assert error_of(await http.post(path), 404)["code"] == "node_not_found"
                for body in ({"deadline_s": 0}, {"deadline_s": 10, "other": 1}):
                    error_of(await http.post("/admin/nodes/decode-0/drain", json=body), 400)
            assert [n.state.value for n in c.backend.server.registry.nodes()] == ["active"] * 3
    run(test)


# ------------------------------------------------------------------ drain and remove


def test_drain_lets_the_running_request_finish_sends_no_new_work_then_tells_the_node_to_leave():
    """A drained decode node finishes its request, gets no new one, is told "leave" at its first idle
    heartbeat and its goodbye is taken; the metrics count one drain, one drained loss, one goodbye."""
    async def test():
        async with mid_stream(max_tokens=3) as (c, p, drained, other, out, http):
            reply = await http.post(f"/admin/nodes/{drained.node_id}/drain", json={"deadline_s": 30})
            assert reply.status_code == 200
            assert (reply.json()["state"], 29 < reply.json()["drain_deadline_s"] <= 30) == ("draining", True)
            await until(lambda: "drain" in drained.commands)
            second = c.generate("r2", max_tokens=1)
            assert (await other.expect(DecodeRequest)).rid == "r2"
            drained.send(TokenDelta("r1", 2, (13,), 2, "c", None, "length"))
            assert view(await out.next()) == ([([11, 12, 13], "abc", "length")], True)
            assert await out.next() is END
            await drained.assert_silent(0.1)
            assert "leave" not in drained.commands          # it still reports a running request
            drained.num_running = 0
            await until(lambda: "leave" in drained.commands)
            drained.stop_heartbeat()
            drained.send(NodeGoodbye(drained.node_id, drained.epoch, "told to leave"))
            await until(lambda: membership(c.backend)["pdserve_router_node_goodbyes_total"] == 1)
            listed = [n["id"] for n in (await http.get("/admin/nodes")).json()["data"]]
            assert listed == sorted(["prefill-0", other.node_id])
            assert membership(c.backend) == counts(3, (1, 1), goodbyes=1, drains=1, extra={
                'pdserve_router_node_losses_total{cause="drained"}': 1})
            second.task.cancel()
    run(test)


def test_drain_deadline_moves_the_running_request_with_an_exact_continuation():
    """A drained node still busy at its deadline, holding nothing it could ship (Paused with 0
    tokens), is told to leave and lost (cause drained): its request continues on the other decode
    node re-prefilled from prompt + the 2 emitted tokens, exactly."""
    async def test():
        async with mid_stream(max_tokens=4) as (c, p, drained, live, out, http):
            reply = await http.post(f"/admin/nodes/{drained.node_id}/drain", json={"deadline_s": 0.2})
            assert reply.status_code == 200
            assert (await drained.expect(PauseRequest)).rid == "r1"
            drained.send(Paused("r1", 0, 0))
            req = await live.expect(DecodeRequest, timeout=5.0)
            await until(lambda: "leave" in drained.commands)
            assert drained.commands.index("drain") < drained.commands.index("leave")
            await continue_on(live, p, req, out)
            assert membership(c.backend) == counts(3, (1, 1), drains=1, extra={
                'pdserve_router_node_losses_total{cause="drained"}': 1,
                'pdserve_router_migrations_total{cause="drained",how="reprefill"}': 1})
    run(test)


def test_remove_moves_the_running_request_at_once_and_the_node_cannot_rejoin_in_its_epoch():
    """POST remove: the node is told "leave" and lost (cause removed) once its request is not held
    (Paused with 0 tokens), and only then answered "removed"; the request continues exactly on the
    other decode node, re-prefilled; a hello or heartbeat in the same epoch is answered "leave"."""
    async def test():
        async with mid_stream(max_tokens=4) as (c, p, removed, live, out, http):
            posted = asyncio.create_task(http.post(f"/admin/nodes/{removed.node_id}/remove"))
            assert (await removed.expect(PauseRequest)).rid == "r1"
            assert not posted.done()                    # the node is still there: no answer yet
            removed.send(Paused("r1", 0, 0))
            reply = await posted
            assert (reply.status_code, reply.json()["state"]) == (200, "removed")
            assert c.backend.server.info(removed.node_id) is None      # out when answered; "leave" on its way
            req = await live.expect(DecodeRequest, timeout=5.0)
            await continue_on(live, p, req, out)
            await until(lambda: "leave" in removed.commands)
            await removed.hello()
            answered = len(removed.commands)
            await until(lambda: len(removed.commands) >= answered + 2)      # two more heartbeats answered
            assert set(removed.commands[removed.commands.index("leave"):]) == {"leave"}
            listed = [n["id"] for n in (await http.get("/admin/nodes")).json()["data"]]
            assert listed == sorted(["prefill-0", live.node_id])
            assert membership(c.backend) == counts(3, (1, 1), removals=1, extra={
                'pdserve_router_node_losses_total{cause="removed"}': 1,
                'pdserve_router_migrations_total{cause="removed",how="reprefill"}': 1})
    run(test)


def test_a_take_outs_node_released_at_an_idle_heartbeat_is_lost_with_the_take_outs_cause():
    """A take-out drains the node with its loss (ControlServer.drain's idle_loss): if the node
    goes idle, and the registry lets it go, before the take-out removes it (its blocks shipped,
    not adopted yet: a race a loaded machine showed end to end), the loss counts as the
    take-out's cause; a plain drain's idle release still counts as drained."""
    async def test():
        async with Cluster() as c:
            p, (d0, d1) = await cast(c)
            d0.num_running = d1.num_running = 0
            c.backend.server.drain(d0.node_id, NodeLoss(LossCause.REMOVED, "operator"))
            c.backend.server.drain(d1.node_id)
            await until(lambda: "leave" in d0.commands and "leave" in d1.commands)
            got = membership(c.backend)
            assert got['pdserve_router_node_losses_total{cause="removed"}'] == 1
            assert got['pdserve_router_node_losses_total{cause="drained"}'] == 1
    run(test)


async def continue_on(live: ScriptedNode, p: ScriptedNode, req: DecodeRequest, out) -> None:
    """r1's move after tokens 11, 12 (of max 4): prompt + both, 2 tokens left; 13, 14 finish it."""
    assert (req.rid, list(req.prompt_ids), req.params.max_tokens, req.prior_outputs) == \
        ("r1~1", PROMPT + [11, 12], 2, 2)
    assert (await p.expect(AbortRequest)).rid == "r1"
    live.send(Reserved("r1~1", "x2", (7, 8), 0))
    assert (await p.expect(PrefillRequest)).kv_endpoint == live.kv_endpoint
    p.send(FirstToken("r1~1", 13, "c", None, ""))
    live.send(TokenDelta("r1~1", 0, (13, 14), 0, "cd", None, "length"))
    while (final := await out.next()) is not END and not final.finished:
        pass
    assert view(final) == ([([11, 12, 13, 14], "abcd", "length")], True)


def test_restarts_and_losses_by_cause_are_counted():
    """note_restart counts per node; a heartbeat loss, a new epoch and an exit each count their cause."""
    async def test():
        async with Cluster(LOSSY) as c:
            p, ds = await cast(c)
            c.backend.note_restart("decode-0")
            await ds[0].hello(epoch="e2")                       # restarted
            c.backend.server.node_exited("decode-0", "status 1")
            ds[1].stop_heartbeat()
            await until(lambda: c.backend.server.info("decode-1") is None)
            assert membership(c.backend) == counts(4, (1, 0), extra={
                'pdserve_router_node_restarts_total{node="decode-0"}': 1,
                'pdserve_router_node_losses_total{cause="restarted"}': 1,
                'pdserve_router_node_losses_total{cause="exited"}': 1,
                'pdserve_router_node_losses_total{cause="heartbeat"}': 1})
    run(test)


def test_a_remove_landing_on_a_drain_deadlines_take_out_is_answered_drained_not_counted():
    """The drain deadline has started taking the node out (its request pausing) when a remove
    lands: the remove waits for that take-out, answers state "drained" (the loss recorded), and
    counts no removal."""
    async def test():
        async with mid_stream(max_tokens=4) as (c, p, drained, live, out, http):
            await http.post(f"/admin/nodes/{drained.node_id}/drain", json={"deadline_s": 0.2})
            assert (await drained.expect(PauseRequest)).rid == "r1"
            operator, started = c.backend.operator, []
            take_out = operator._take_out
            operator._take_out = lambda node_id, loss: started.append(take_out(node_id, loss)) or started[-1]
            removing = asyncio.create_task(http.post(f"/admin/nodes/{drained.node_id}/remove"))
            await until(lambda: started)    # the remove has found the take-out under way: starts none
            assert started == [False] and not removing.done()
            drained.send(Paused("r1", 0, 0))
            reply = await removing
            assert reply.status_code == 200 and reply.json()["state"] == "drained"
            got = membership(c.backend)
            assert got["pdserve_router_node_removals_total"] == 0
            assert got['pdserve_router_node_losses_total{cause="drained"}'] == 1
            assert 'pdserve_router_node_losses_total{cause="removed"}' not in got
    run(test)


def test_the_cluster_ends_a_remove_still_under_way_and_raises_one_that_failed():
    """Cluster's exit cancels and awaits a remove still waiting for its node's request to move
    (none is left pending); a remove that failed by itself (an unknown node) raises at the exit
    of a test that passed, not as an exception nobody retrieved, and the exit still closes the
    router's socket, the nodes and the ZMQ context."""
    async def test():
        async with mid_stream(max_tokens=4) as (c, p, d1, _, out, http):
            removing = c.remove(d1.node_id)
            assert (await d1.expect(PauseRequest)).rid == "r1"
            assert not removing.done()
        assert removing.cancelled()
        with pytest.raises(KeyError, match="decode-9"):
            async with Cluster() as c:
                node = await c.node("prefill-0", "prefill")
                await until(c.remove("decode-9").done)
        assert c.backend.server._sock is None and node.sock.closed and c.ctx.closed   # closed all the same
    run(test)
