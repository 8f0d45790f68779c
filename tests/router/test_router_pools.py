"""Pools at run time: which nodes a scale-down drains, the limits of a scale, a router without a
scaler (409), `pdserve pools | scale`, and a node stopped while still starting."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from kvtransport.testing import TEST_SECRET
from router import operator_cli
from router.cluster.pool_scaler import check_scale, surplus
from router.cluster.registry import NodeLoad, NodeRegistry, NodeRole
from router.fleet_scaler import FleetScaler
from router.node_processes import ClusterConfig, LocalFleet
from tests.disagg_harness import Cluster, run, until
from tests.router.test_router_operator import ADMIN
from tests.router.test_router_operator_cli import cli, live


def test_surplus_drains_the_least_busy_then_the_newest_and_never_a_draining_node():
    registry = NodeRegistry(heartbeat_timeout_s=5.0)
    for i, (requests, usage) in enumerate([(2, 0.5), (0, 0.1), (0, 0.1), (0, 0.0), (1, 0.0)]):
        node = registry.register(f"decode-{i}", NodeRole.DECODE, f"tcp://127.0.0.1:{7000 + i}")
        node.inflight_requests = requests
        registry.heartbeat(node.node_id, NodeLoad(requests, 0, usage))
    registry.register("prefill-0", NodeRole.PREFILL, "")
    assert surplus(registry, "decode", 5) == []
    assert surplus(registry, "decode", 2) == ["decode-3", "decode-2", "decode-1"]
    registry.drain("decode-3")
    assert surplus(registry, "decode", 2) == ["decode-2", "decode-1"]
    assert surplus(registry, "decode", 0) == ["decode-2", "decode-1", "decode-4", "decode-0"]
    assert surplus(registry, "prefill", 0) == ["prefill-0"]


@pytest.mark.parametrize("role, count, message", [
    ("decode", 17, "a decode pool holds 0 to 16 nodes (--max-pool-size), not 17"),
    ("decode", -1, "a decode pool holds 0 to 16 nodes (--max-pool-size), not -1"),
    ("mixed", 1, "no pool 'mixed': the pools are prefill, decode")])
def test_a_scale_out_of_bounds_is_refused_by_name(role, count, message):
    check_scale("prefill", 16, 16)
    with pytest.raises(ValueError) as err:
        check_scale(role, count, 16)
    assert str(err.value) == message


def test_max_pool_size_covers_the_nodes_started():
    with pytest.raises(ValueError, match="max_pool_size"):
        ClusterConfig(prefill=1, decode=3, max_pool_size=2)


def test_cli_lists_pools_and_a_router_without_a_scaler_refuses_to_scale(capsys, monkeypatch):
    """pools: a row per role with no target; scale on a router whose nodes were started by hand: 409
    with the way out; scale with no pool named: usage error."""
    monkeypatch.setenv(operator_cli.ENV_VAR, ADMIN)

    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            server, task, url = await live(c)
            try:
                assert await cli("pools", "--url", url) == 0
                assert [line.split() for line in capsys.readouterr().out.splitlines()] == [
                    ["POOL", "TARGET", "ACTIVE", "DRAINING", "STARTING"],
                    ["prefill", "None", "1", "0", "0"], ["decode", "None", "1", "0", "0"]]
                assert await cli("scale", "--decode", "2", "--url", url) == 1
                assert capsys.readouterr().err.startswith(
                    "pdserve scale: 409 this router does not start nodes itself (pdserve router)")
                assert await cli("scale", "--url", url) == 2
            finally:
                server.should_exit = True
                await task
    run(test)


def test_a_node_scaled_away_while_starting_is_stopped_and_not_restarted():
    """1 -> 2 -> 1 before the new node registers: the starting node gets SIGTERM, exits, and the
    supervisor reports it without starting it again; the registered pool is untouched."""
    cluster = ClusterConfig(prefill=0, decode=0, max_pool_size=4, restart_backoff_s=0.0)
    registry = NodeRegistry(heartbeat_timeout_s=5.0)
    registry.register("decode-9", NodeRole.DECODE, "tcp://127.0.0.1:7000")     # a node started by hand
    exits: list[str] = []
    backend = SimpleNamespace(server=SimpleNamespace(registry=registry, node_exited=lambda node_id, _: exits.append(node_id)),
                              operator=SimpleNamespace(scaler=None))
    fleet = LocalFleet(cluster, ["--model", "/nonexistent-never-loads"])

    async def test():
        fleet.start("tcp://127.0.0.1:9", backend, TEST_SECRET)
        scaler = FleetScaler(fleet, registry, None, dataclasses.replace(cluster, decode=1))
        await scaler.scale("decode", 2, 1.0)
        assert [n.node_id for n in fleet.nodes] == ["decode-0"] and scaler.starting("decode") == 1
        watch = asyncio.create_task(fleet.supervise(backend))
        await scaler.scale("decode", 1, 1.0)
        assert scaler.targets() == {"prefill": 0, "decode": 1}
        await asyncio.wait_for(asyncio.to_thread(fleet.nodes[0].process.wait), 30)
        await until(lambda: exits)              # the supervisor's turn: reported (a restart comes in that turn)
        watch.cancel()
        assert (exits, fleet.nodes[0].restarts, len(fleet.nodes), scaler.starting("decode")) == (["decode-0"], 0, 1, 0)
        assert [n.node_id for n in registry.nodes()] == ["decode-9"]
    try:
        asyncio.run(test())
    finally:
        fleet.stop()
