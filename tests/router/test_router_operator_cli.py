"""`pdserve nodes / drain / remove` (router/operator_cli.py) against a live router: the real app
under uvicorn on a free loopback port, its DisaggregatedBackend serving scripted nodes."""
from __future__ import annotations

import asyncio

import uvicorn

from router import operator_cli
from router.http.app import create_app
from router.cluster.registry import NodeState
from tests.disagg_harness import Cluster, run, until
from tests.http_server import free_port
from tests.router.test_router_operator import ADMIN, APP_CONFIG


async def live(c: Cluster) -> tuple[uvicorn.Server, asyncio.Task, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(c.backend, APP_CONFIG), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started)
    return server, task, f"http://127.0.0.1:{port}"


async def cli(*argv: str) -> int:
    """Runs the CLI on a thread (it blocks), as an operator's shell would beside the router."""
    return await asyncio.to_thread(operator_cli.main, list(argv))


def test_cli_lists_drains_and_removes_nodes(capsys, monkeypatch, tmp_path):
    """nodes prints one row per node; drain and remove act and say so; the key comes from the
    environment or a file; a wrong key, no key or an unknown node fail with the router's message."""
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN + "\n")

    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode"), await c.node("decode-1", "decode")
            server, task, url = await live(c)
            try:
                monkeypatch.setenv(operator_cli.ENV_VAR, ADMIN)
                assert await cli("nodes", "--url", url) == 0
                rows = [line.split() for line in capsys.readouterr().out.splitlines()]
                assert [r[:8] + r[9:] for r in rows] == [
                    ["NODE", "ROLE", "STATE", "RUN", "WAIT", "KV%", "FREE", "EPOCH", "ADDRESS"],
                    ["decode-0", "decode", "active", "1", "0", "0", "64", "e1", c.nodes["decode-0"].kv_endpoint],
                    ["decode-1", "decode", "active", "1", "0", "0", "64", "e1", c.nodes["decode-1"].kv_endpoint],
                    ["prefill-0", "prefill", "active", "1", "0", "0", "64", "e1", "-"]]
                assert await cli("drain", "decode-1", "--deadline-s", "30", "--url", url) == 0
                assert capsys.readouterr().out == "decode-1: draining; its requests move in 30 s if not done\n"
                assert c.backend.server.registry.get("decode-1").state is NodeState.DRAINING
                monkeypatch.delenv(operator_cli.ENV_VAR)
                assert await cli("remove", "decode-0", "--url", url, "--admin-key-file", str(key_file)) == 0
                assert capsys.readouterr().out == "decode-0: removed\n"
                assert c.backend.server.info("decode-0") is None
                assert await cli("remove", "decode-9", "--url", url, "--admin-key-file", str(key_file)) == 1
                assert capsys.readouterr().err == "pdserve remove: 404 no node 'decode-9' is registered\n"
                monkeypatch.setenv(operator_cli.ENV_VAR, "wrong")
                assert await cli("nodes", "--url", url) == 1
                assert capsys.readouterr().err == "pdserve nodes: 401 Incorrect API key provided.\n"
                monkeypatch.delenv(operator_cli.ENV_VAR)
                assert await cli("nodes", "--url", url) == 2
            finally:
                server.should_exit = True
                await task
    run(test)
