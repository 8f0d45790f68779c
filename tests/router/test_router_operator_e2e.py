"""Scaling a decode pool down with the operator API while requests flow, over real node processes."""
from __future__ import annotations

import asyncio

from pdwire.sampling_params import SamplingParams
from router.config import RouterConfig
from router.node_processes import ClusterConfig
from tests.router.test_router_disagg_e2e import PROMPTS, _collect, _with_cluster
from tests.router.test_router_operator import counts, membership

REQUESTS, CONCURRENCY, MAX_TOKENS = 24, 4, 12


def test_draining_two_of_three_decode_nodes_under_a_stream_fails_nothing_and_leaks_no_block(model_dir):
    """3 -> 1 decode nodes under a steady stream: every request finishes with its full greedy
    length and the same tokens as every other request on its prompt; both drained node processes
    exit; every surviving node reports all its blocks free at the end."""
    path, _ = model_dir

    async def test(backend, nodes):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        slots, done = asyncio.Semaphore(CONCURRENCY), []

        async def one(i: int):
            async with slots:
                out = await _collect(backend, f"s{i}", PROMPTS[i % 2], params)
                done.append(i)
                return out
        stream = [asyncio.create_task(one(i)) for i in range(REQUESTS)]
        while len(done) < CONCURRENCY:                   # the stream is flowing on all three nodes
            await asyncio.sleep(0.02)
        for node_id in ("decode-0", "decode-1"):
            backend.operator.drain(node_id, deadline_s=1.0)
        outs = await asyncio.gather(*stream)
        for i, out in enumerate(outs):
            assert out.finished and out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == outs[i % 2].outputs[0].token_ids
            assert len(out.outputs[0].token_ids) == MAX_TOKENS
        drained = [n for n in nodes if n.node_id in ("decode-0", "decode-1")]
        await _until(lambda: all(n.process.poll() is not None for n in drained))
        assert [v.id for v in backend.operator.nodes()] == ["decode-2", "prefill-0"]
        await _until(lambda: all(v.num_free_blocks == v.num_blocks and v.num_running == 0
                                 for v in backend.operator.nodes()))
        got = membership(backend)
        assert {k: v for k, v in got.items() if k in counts(0, (0, 0))} == counts(4, (1, 1), goodbyes=2, drains=2)
        assert got['pdserve_router_node_losses_total{cause="drained"}'] == 2
    _with_cluster(path, RouterConfig(heartbeat_timeout_s=30.0), ClusterConfig(1, 3), test)


async def _until(ok, timeout: float = 30.0) -> None:
    async def poll():
        while not ok():
            await asyncio.sleep(0.1)
    await asyncio.wait_for(poll(), timeout)
