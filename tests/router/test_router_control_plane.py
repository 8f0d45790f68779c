"""DisaggregatedBackend against scripted node peers (tests/disagg_harness.py): its control plane
when peers misbehave or come and go: hostile frames, heartbeats and epochs, the registry's checks
on a node's hello, rejections before anything is sent, a goodbye, and the metrics that show them."""
from __future__ import annotations

import asyncio

import pytest
import zmq

from pdwire import control
from pdwire.control import DecodeRequest, FirstToken, NodeCommand, NodeGoodbye, NodeHello, NodeStatus, TokenDelta
from router.backend import NoNodeAvailable
from router.cluster.registry import NodeRole
from router.config import RouterConfig
from router.http.metrics import RouterMetrics
from tests.disagg_harness import (BLOCK, LOSSY, PROMPT, BEAT_S, END, ScriptedNode, Cluster, run, until, view,
                                  counter, admit)


def test_garbage_frames_are_dropped_and_counted_while_a_request_completes():
    """Malformed, unsealed, unexpected, unauthenticated and stray frames are dropped without harm
    to live work."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            rogue = c.ctx.socket(zmq.DEALER)
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(c.backend.control_endpoint)
            out = c.generate(max_tokens=2)
            await admit(d, p)
            for junk in (b"", b"\xc1", b"\x93\x01\xa3bad\x90", control.encode(NodeCommand("ok"))[:-1]):
                p.sock.send(junk)
            p.sock.send_multipart([b"two", b"frames"])
            rogue.send_multipart([control.encode(FirstToken("r1", 99, "evil", None, "stop")), b"t" * 40])
            p.send(NodeCommand("leave"))                                # a router-to-node kind
            p.send(FirstToken("nobody", 1, "x", None, ""))              # no such request
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            dropped = c.backend.server.dropped
            counts = lambda: {r: counter(dropped, {"reason": r}) for r in (   # noqa: E731
                "malformed", "bad_mac", "unexpected", "not_authenticated", "stray")}
            # the rogue's frame comes on its own connection: nothing orders it before d's last delta
            expected = {"malformed": 4, "bad_mac": 1, "unexpected": 1, "not_authenticated": 1, "stray": 1}
            await until(lambda: counts() == expected)
            await asyncio.sleep(3 * BEAT_S)     # and nothing is counted twice
            assert counts() == expected
            assert c.backend.is_healthy()
            rogue.close(0)
    run(test)


def test_heartbeat_expiry_removes_a_node():
    """A node silent for heartbeat_timeout_s leaves metrics and health; its next status gets 'register'."""
    async def test():
        async with Cluster(LOSSY) as c:
            p, d = await c.pair()
            d.kv_usage = 0.5
            await until(lambda: {m.node_id: m.kv_usage for m in c.backend.metrics()}.get("decode-0") == 0.5)
            assert c.backend.is_healthy()
            metrics = {m.node_id: m for m in c.backend.metrics()}
            assert (metrics["decode-0"].role, metrics["decode-0"].kv_usage,
                    metrics["decode-0"].num_running, metrics["decode-0"].num_preemptions) == ("decode", 0.5, 1, 2)
            d.stop_heartbeat()
            await until(lambda: [m.node_id for m in c.backend.metrics()] == ["prefill-0"], timeout=4.0)
            assert not c.backend.is_healthy()
            d.send(NodeStatus("decode-0", "e1", 0, 0, 0.0, 0.0, 0, 10))
            await until(lambda: d.commands[-1] == "register")
            await d.hello()
            assert c.backend.is_healthy()
    run(test)


def test_status_from_a_stale_epoch_is_told_to_register():
    """A heartbeat carrying an epoch other than the registered one is answered 'register'."""
    async def test():
        async with Cluster() as c:
            d = await c.node("decode-0", "decode")
            d.stop_heartbeat()
            d.send(NodeStatus("decode-0", "old", 0, 0, 0.0, 0.0, 0, 10))
            await until(lambda: d.commands[-1] == "register")
    run(test)


def test_node_with_another_block_size_is_refused():
    """A node whose block size differs from the registered nodes' is told to leave, not registered."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            odd = ScriptedNode(c.ctx, c.backend.control_endpoint, "decode-9", "decode")
            c.nodes["decode-9"] = odd
            await odd.connect()
            await odd.hello(block_size=2 * BLOCK)
            assert odd.commands == ["leave"]
            assert c.backend.server.count(NodeRole.DECODE) == 0
    run(test)


@pytest.mark.parametrize("kv_endpoint", ["", "tcp://no such host:5", "tcp://127.0.0.1", "tcp://d0:70000",
                                         "tcp://[::1:5", "udp://127.0.0.1:5", "tcp://127.0.0.1:5/decode-0"])
def test_decode_node_with_a_malformed_kv_endpoint_is_refused(kv_endpoint):
    """A decode node whose kv_endpoint no prefill node could connect to is told to leave, counted as
    incompatible, not registered: no prefill node is ever sent to it."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            odd = ScriptedNode(c.ctx, c.backend.control_endpoint, "decode-9", "decode")
            c.nodes["decode-9"], odd.kv_endpoint = odd, kv_endpoint
            await odd.connect()
            await odd.hello()
            assert odd.commands == ["leave"]
            assert c.backend.server.count(NodeRole.DECODE) == 0
            assert counter(c.backend.server.dropped, {"reason": "incompatible"}) == 1
    run(test)


def test_max_model_len_is_the_smallest_of_model_and_nodes():
    """max_model_len comes from the model folder, lowered by what the nodes can hold."""
    async def test():
        async with Cluster() as c:
            assert c.backend.max_model_len == 256
            node = await c.node("prefill-0", "prefill")
            node.send(NodeHello("prefill-0", "e1", "prefill", "", 64, BLOCK, 100))
            await until(lambda: c.backend.max_model_len == 100)
    run(test)


# ------------------------------------------------------------------ rejections and metrics


def test_rejections_raise_value_error_before_anything_is_sent():
    """Empty or too long a prompt, bad token ids, duplicate ids, stop ids outside the vocabulary,
    beam search and more prompt logprobs than one control message carries raise ValueError;
    nodes hear nothing."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            first = c.generate("dup")
            await d.expect(DecodeRequest)
            for rid, prompt in (("a", []), ("b", [1] * 256), ("c", [512]), ("dup", PROMPT)):
                err = await c.generate(rid, prompt).next()
                assert isinstance(err, ValueError), (rid, err)
            for rid, params in (("e", dict(stop_token_ids=[512])), ("f", dict(beam_width=2)),
                                ("g", dict(prompt_logprobs=20, prompt=[1] * 20000))):
                err = await c.generate(rid, **params).next()
                assert isinstance(err, ValueError) and params.popitem()[0].split("_")[0] in str(err), (rid, err)
            await d.assert_silent(), await p.assert_silent()
            await c.backend.abort("dup")
            assert await first.next() is END
    run(test)


def test_no_nodes_is_no_node_available_at_once():
    """A fresh request with no live nodes fails with NoNodeAvailable (HTTP 503) without waiting:
    the reason a wait for a node would give ("... within the admission timeout") is not it."""
    async def test():
        async with Cluster() as c:
            err = await c.generate().next()
            assert isinstance(err, NoNodeAvailable) and str(err) == "no live prefill or decode node"
    run(test)


def test_prometheus_exposes_router_counters_and_nodes():
    """/metrics shows each node's gauges, its KV transfer counters, and the router's retry,
    migration, busy and drop counters."""
    async def test():
        async with Cluster() as c:
            p, d = await c.pair()
            p.kv_counters = (6, 6 << 30, 0, 0, 2, 0, 0)
            d.kv_counters = (0, 0, 6, 6 << 30, 2, 1, 3)
            await until(lambda: {m.node_id: tuple(m.kv) for m in c.backend.metrics()} ==
                        {"prefill-0": p.kv_counters, "decode-0": d.kv_counters})    # heartbeats with them came
            text = RouterMetrics(c.backend).render().decode()
            for series in ("pdserve_router_retries_total", "pdserve_router_migrations_total",
                           'pdserve_router_busy_replies_total{role="prefill"} 0.0',
                           'pdserve_num_requests_running{node="decode-0",role="decode"} 1.0',
                           'pdserve_kv_bytes_sent_total{node="prefill-0",role="prefill"} 6.442450944e+09',
                           'pdserve_kv_blocks_received_total{node="decode-0",role="decode"} 6.0',
                           'pdserve_kv_transfers_failed_total{node="decode-0",role="decode"} 1.0',
                           'pdserve_kv_frames_dropped_total{node="decode-0",role="decode"} 3.0'):
                assert series in text, series
    run(test)


def test_a_goodbye_loses_the_node_at_once_and_a_stale_one_is_dropped():
    """A node's NodeGoodbye (its epoch) takes it out of the registry and health at once, its
    request fails over; a goodbye naming another epoch changes nothing."""
    async def test():
        async with Cluster(RouterConfig(heartbeat_timeout_s=60.0, admission_timeout_s=5.0, local_prefill_tokens=0)) as c:
            p, d = await c.pair()
            d.send(NodeGoodbye("decode-0", "other-epoch", "SIGTERM"))
            await until(lambda: counter(c.backend.server.dropped, {"reason": "unexpected"}) == 1)   # handled
            assert c.backend.server.count(NodeRole.DECODE) == 1
            d.send(NodeGoodbye("decode-0", d.epoch, "SIGTERM"))
            await until(lambda: c.backend.server.count(NodeRole.DECODE) == 0)
            assert not c.backend.is_healthy()
            assert counter(c.backend.server.dropped, {"reason": "unexpected"}) == 1
    run(test)
