"""Scaling a pool up and down at run time (/admin/pools, router/local_scaler.py) over real node
processes on this machine, while requests flow."""
from __future__ import annotations

import asyncio
import dataclasses

from kvtransport.testing import TEST_SECRET
from pdwire.control import KV_COUNTERS
from pdwire.sampling_params import SamplingParams
from router.cluster.disaggregated import DisaggregatedBackend
from router.local_scaler import LocalScaler
from router.node_processes import ClusterConfig, NodeSpawner, stop_nodes
from tests.router.test_router_disagg_e2e import NODE_FLAGS, PROMPTS, _collect, _registered
from tests.router.test_router_operator import APP_CONFIG, admin_client
from tests.router.test_router_operator_e2e import _until

MAX_TOKENS, CONCURRENCY = 12, 3


def test_decode_pool_scales_up_and_down_under_a_stream_with_no_failed_request(model_dir):
    """1 -> 2 decode nodes while a stream runs: the new node registers and serves; 2 -> 1: the
    surplus drains and its process exits 0. Every request finishes with its full greedy length and
    the tokens of every other request on its prompt; a count over --max-pool-size or an unknown
    pool is a 400 before anything starts; the survivors end with every block free."""
    path, _ = model_dir
    config = dataclasses.replace(APP_CONFIG, heartbeat_timeout_s=30.0)
    cluster = ClusterConfig(1, 1, max_pool_size=2)

    async def main():
        backend = DisaggregatedBackend.from_model(path, TEST_SECRET, config)
        nodes = []
        try:
            spawner = NodeSpawner(await backend.start(), cluster, ["--model", path, *NODE_FLAGS], TEST_SECRET)
            nodes.extend(spawner.spawn_pools(cluster))
            backend.operator.scaler = LocalScaler(spawner, nodes, backend.operator, backend.server.registry, cluster)
            await _registered(backend, nodes)
            async with admin_client(backend, config) as http:
                await asyncio.wait_for(_scale_under_a_stream(backend, nodes, http), 180)
        finally:
            backend.close()
            stop_nodes(nodes)
    asyncio.run(main())


async def _scale_under_a_stream(backend, nodes, http) -> None:
    over = await http.post("/admin/pools/decode", json={"count": 3})
    assert (over.status_code, "--max-pool-size" in over.json()["error"]["message"]) == (400, True)
    assert (await http.post("/admin/pools/mixed", json={"count": 1})).status_code == 400
    assert len(nodes) == 2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    slots, outs = asyncio.Semaphore(CONCURRENCY), {}

    async def one(i: int) -> None:
        async with slots:
            outs[i] = await _collect(backend, f"s{i}", PROMPTS[i % 2], params)
    first = [asyncio.create_task(one(i)) for i in range(6)]
    up = await http.post("/admin/pools/decode", json={"count": 2})
    assert up.status_code == 200 and (up.json()["target"], up.json()["starting"]) == (2, 1)
    await _until(lambda: backend.server.info("decode-1") is not None, timeout=120)
    second = [asyncio.create_task(one(i)) for i in range(6, 18)]
    await _until(lambda: _transfers(backend, "decode-1") > 0, timeout=60)
    down = await http.post("/admin/pools/decode", json={"count": 1, "drain_deadline_s": 1.0})
    assert down.status_code == 200 and (down.json()["active"], down.json()["draining"]) == (1, 1)
    drained = [n for n in nodes if n.node_id in {v.id for v in backend.operator.nodes() if v.state == "draining"}]
    await asyncio.gather(*first, *second)
    for i, out in outs.items():
        assert out.finished and len(out.outputs[0].token_ids) == MAX_TOKENS
        assert out.outputs[0].token_ids == outs[i % 2].outputs[0].token_ids
    assert len(drained) == 1
    await _until(lambda: drained[0].process.poll() is not None)
    assert drained[0].process.returncode == 0
    pools = {p["role"]: p for p in (await http.get("/admin/pools")).json()["data"]}
    assert pools["decode"] == {"role": "decode", "target": 1, "active": 1, "draining": 0, "starting": 0}
    await _until(lambda: all(v.num_free_blocks == v.num_blocks and v.num_running == 0
                             for v in backend.operator.nodes()))


def _transfers(backend, node_id: str) -> int:
    for m in backend.metrics():
        if m.node_id == node_id:
            return dict(zip(KV_COUNTERS, m.kv)).get("kv_transfers_done", 0)
    return 0
