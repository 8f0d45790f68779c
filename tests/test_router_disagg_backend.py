"""DisaggregatedBackend against scripted node peers: test doubles of the node processes that speak
the real control protocol over real ZMQ DEALER sockets, so the router side runs exactly as served."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import uvloop
import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from kvtransport import control
from kvtransport.control import (AbortRequest, DecodeRequest, FirstToken, NodeCommand, NodeHello, NodeStatus,
                                 PrefillRequest, RequestFailed, TokenDelta)
from kvtransport.messages import Busy, Reserved
from router.config import RouterConfig
from router.disaggregated import DisaggregatedBackend
from router.metrics import RouterMetrics
from router.policy import NoNodeAvailable
from router.registry import NodeRole

BLOCK = 4
PROMPT = [5, 6, 7, 8, 9, 10]            # 2 blocks of 4
CONFIG = RouterConfig(heartbeat_timeout_s=0.5, admission_timeout_s=5.0)
BEAT_S = 0.05
_END = object()


class ScriptedNode:
    """A node process as the router sees it: a DEALER whose routing id is the node id, saying hello,
    heartbeating, and answering requests as each test scripts it."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, node_id: str, role: str, epoch: str = "e1"):
        self.node_id, self.role, self.epoch = node_id, role, epoch
        self.kv_endpoint = f"tcp://127.0.0.1:{7000 + len(node_id)}/{node_id}" if role == "decode" else ""
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, node_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.commands: list[str] = []
        self.kv_usage = 0.0
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> ScriptedNode:
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]
        await self.hello()
        return self

    async def hello(self, epoch: str | None = None, block_size: int = BLOCK) -> None:
        self.epoch = epoch or self.epoch
        before = len(self.commands)
        self.send(NodeHello(self.node_id, self.epoch, self.role, self.kv_endpoint, 64, block_size, 256))
        await _until(lambda: len(self.commands) > before)

    def send(self, msg) -> None:
        self.sock.send(control.encode(msg))

    async def expect(self, cls: type, timeout: float = 5.0):
        msg = await asyncio.wait_for(self.inbox.get(), timeout)
        assert isinstance(msg, cls), f"{self.node_id} expected {cls.__name__}, got {msg!r}"
        return msg

    async def assert_silent(self, wait: float = 0.2) -> None:
        await asyncio.sleep(wait)
        assert self.inbox.empty(), f"{self.node_id} got {self.inbox.get_nowait()!r}"

    def stop_heartbeat(self) -> None:
        self._tasks[1].cancel()

    def die(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close(linger=0)

    async def _read(self) -> None:
        while True:
            msg = control.decode(await self.sock.recv())
            if isinstance(msg, NodeCommand):
                self.commands.append(msg.command)
            else:
                self.inbox.put_nowait(msg)

    async def _beat(self) -> None:
        while True:
            self.send(NodeStatus(self.node_id, self.epoch, 1, 0, self.kv_usage, 0.25, 2, 10))
            await asyncio.sleep(BEAT_S)


class Consumer:
    """Iterates a generate() stream on its own task, as the HTTP app does."""

    def __init__(self, stream):
        self.stream = stream
        self.items: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for output in self.stream:
                self.items.put_nowait(output)
            self.items.put_nowait(_END)
        except Exception as err:    # noqa: BLE001 -- the test asserts on it
            self.items.put_nowait(err)

    async def next(self, timeout: float = 5.0):
        return await asyncio.wait_for(self.items.get(), timeout)


class Cluster:
    """A started backend with scripted nodes; closes everything on exit."""

    def __init__(self, config: RouterConfig = CONFIG):
        self.backend = DisaggregatedBackend(None, "test-model", 256, config, vocab_size=512)
        self.ctx = zmq.asyncio.Context()
        self.nodes: dict[str, ScriptedNode] = {}

    async def __aenter__(self) -> Cluster:
        await self.backend.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.backend.close()
        for node in self.nodes.values():
            node.die()
        self.ctx.term()

    async def node(self, node_id: str, role: str, epoch: str = "e1") -> ScriptedNode:
        node = ScriptedNode(self.ctx, self.backend.control_endpoint, node_id, role, epoch)
        self.nodes[node_id] = node
        return await node.start()

    def generate(self, rid: str = "r1", prompt=None, **params) -> Consumer:
        params = {"temperature": 0.0, "max_tokens": 8, **params}
        return Consumer(self.backend.generate(rid, PROMPT if prompt is None else prompt,
                                              SamplingParams(**params)))


def run(test, loop: str = "asyncio"):
    async def bounded():
        return await asyncio.wait_for(test(), 20)
    return uvloop.run(bounded()) if loop == "uvloop" else asyncio.run(bounded())


async def _until(ok, timeout: float = 5.0) -> None:
    async def poll():
        while not ok():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout)


async def first_of(nodes: list[ScriptedNode], cls: type, timeout: float = 5.0):
    """(node, message) from whichever node gets a message first; asserts its type."""
    got: list = []

    def ready() -> bool:
        for node in nodes:
            if not node.inbox.empty():
                got.append((node, node.inbox.get_nowait()))
                return True
        return False
    await _until(ready, timeout)
    node, msg = got[0]
    assert isinstance(msg, cls), f"{node.node_id} expected {cls.__name__}, got {msg!r}"
    return node, msg


def view(output) -> tuple:
    return [(c.token_ids, c.text, c.finish_reason) for c in output.outputs], output.finished


def counter(collector, labels: dict | None = None) -> float:
    for metric in collector.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and (labels is None or sample.labels == labels):
                return sample.value
    return 0.0


async def _admit(d: ScriptedNode, p: ScriptedNode, rid: str = "r1", xfer: str = "x1") -> PrefillRequest:
    """D reserves blocks 3 and 4; returns P's PrefillRequest."""
    await d.expect(DecodeRequest)
    d.send(Reserved(rid, xfer, (3, 4), 0))
    return await p.expect(PrefillRequest)


# ------------------------------------------------------------------ happy path


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_first_token_then_deltas_give_exact_cumulative_outputs(loop):
    """P's first token is emitted before D sends anything; D's re-sent token 0 is not emitted twice."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate(max_tokens=4, logprobs=1)
            req = await d.expect(DecodeRequest)
            assert (req.rid, list(req.prompt_ids), req.prefill_node_id) == ("r1", PROMPT, "prefill-0")
            assert (req.params.n, req.params.max_tokens, req.params.logprobs) == (1, 4, 1)
            d.send(Reserved("r1", "x1", (3, 4), 1))
            pre = await p.expect(PrefillRequest)
            assert (pre.rid, list(pre.prompt_ids), pre.kv_endpoint) == ("r1", PROMPT, d.kv_endpoint)
            assert (pre.xfer_id, pre.dst_block_ids, pre.cached_prefix_blocks) == ("x1", (3, 4), 1)
            p.send(FirstToken("r1", 11, "a", [[11, -0.1], [12, -2.0]], ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", ([[12, -0.2]],), ""))
            assert view(await out.next()) == ([([11, 12], "ab", None)], False)
            d.send(TokenDelta("r1", 2, (13, 14), 2, "cd", ([[13, -0.3]], [[14, -0.4]]), "length"))
            final = await out.next()
            assert view(final) == ([([11, 12, 13, 14], "abcd", "length")], True)
            assert final.outputs[0].logprobs == [{11: -0.1, 12: -2.0}, {12: -0.2}, {13: -0.3}, {14: -0.4}]
            assert final.prompt_token_ids == PROMPT
            assert await out.next() is _END
            await p.assert_silent(), await d.assert_silent()    # a finished request is not aborted
            assert [(n.inflight_requests, n.inflight_blocks) for n in c.backend.server.registry.nodes()] \
                == [(0, 0), (0, 0)]
    run(test, loop)


def test_decode_delta_before_first_token_is_held_until_it():
    """A delta from D that overtakes P's FirstToken waits for it; every token is emitted once, in order."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate(max_tokens=3)
            await _admit(d, p)
            d.send(TokenDelta("r1", 1, (12,), 1, "b", None, ""))
            d.send(TokenDelta("r1", 0, (11, 12, 13), 0, "abc", None, "stop"))
            await asyncio.sleep(0.1)
            assert out.items.empty()
            p.send(FirstToken("r1", 11, "a", None, ""))
            final = await out.next()
            assert view(final) == ([([11, 12, 13], "abc", "stop")], True)
    run(test)


def test_first_token_that_finishes_aborts_the_decode_reservation():
    """A request finished by P's first token frees D's reserved blocks (AbortRequest to D)."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate(max_tokens=1)
            await _admit(d, p)
            p.send(FirstToken("r1", 2, "", None, "stop"))
            assert view(await out.next()) == ([([2], "", "stop")], True)
            assert (await d.expect(AbortRequest)).rid == "r1"
    run(test)


def test_n_fans_out_with_seeds_and_merges_by_index():
    """n = 2 runs rid#0 and rid#1 with seed and seed + 1, merged as outputs 0 and 1."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate(n=2, seed=7, temperature=1.0, max_tokens=1)
            reqs = {}
            for _ in range(2):
                req = await d.expect(DecodeRequest)
                reqs[req.rid] = req
                d.send(Reserved(req.rid, f"x{len(reqs)}", (3, 4), 0))
            assert {rid: (r.params.n, r.params.seed) for rid, r in reqs.items()} == \
                {"r1#0": (1, 7), "r1#1": (1, 8)}
            for _ in range(2):
                pre = await p.expect(PrefillRequest)
                p.send(FirstToken(pre.rid, 20 + int(pre.rid[-1]), pre.rid[-1], None, "length"))
            while not (final := await out.next()).finished:
                assert not all(o.finish_reason for o in final.outputs)
            assert view(final) == ([([20], "0", "length"), ([21], "1", "length")], True)
    run(test)


# ------------------------------------------------------------------ backpressure


def test_busy_decode_node_is_skipped_for_another():
    """Busy from one D sends the request to the other D at once, without waiting retry_after_ms."""
    async def test():
        async with Cluster() as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=1)
            busy_d, req = await first_of(ds, DecodeRequest)
            busy_d.send(Busy("r1", "no free blocks", 60_000))
            other = ds[1 - ds.index(busy_d)]
            req2 = await other.expect(DecodeRequest, timeout=1.0)
            assert (req2.rid, req2.prompt_ids) == (req.rid, req.prompt_ids)
            other.send(Reserved("r1", "x1", (3, 4), 0))
            assert (await p.expect(PrefillRequest)).kv_endpoint == other.kv_endpoint
            p.send(FirstToken("r1", 9, "z", None, "length"))
            assert view(await out.next()) == ([([9], "z", "length")], True)
            assert counter(c.backend.collectors()[2]) == 1
            await busy_d.assert_silent()    # Busy held nothing: nothing to abort there
    run(test)


def test_all_busy_waits_retry_after_then_times_out():
    """With every D busy the router asks again after retry_after_ms; past the admission deadline: 503."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, admission_timeout_s=0.6)) as c:
            await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            loop = asyncio.get_running_loop()
            out = c.generate()
            asked = []
            for _ in range(2):
                await d.expect(DecodeRequest)
                asked.append(loop.time())
                d.send(Busy("r1", "full", 200))
            assert asked[1] - asked[0] >= 0.19
            err = await out.next(timeout=2.0)
            assert isinstance(err, NoNodeAvailable)
    run(test)


# ------------------------------------------------------------------ failures


def test_prefill_failure_before_first_token_retries_on_another_prefill_node():
    """RequestFailed from P before its first token: D's reservation is aborted and the request reruns
    on the other P, under a new wire rid, with nothing emitted twice."""
    async def test():
        async with Cluster() as c:
            ps = [await c.node("prefill-0", "prefill"), await c.node("prefill-1", "prefill")]
            d = await c.node("decode-0", "decode")
            out = c.generate(max_tokens=2)
            await d.expect(DecodeRequest)
            d.send(Reserved("r1", "x1", (3, 4), 0))
            bad_p, _ = await first_of(ps, PrefillRequest)
            bad_p.send(RequestFailed("r1", "transfer refused", True))
            assert (await d.expect(AbortRequest)).rid == "r1"
            assert (await bad_p.expect(AbortRequest)).rid == "r1"
            req = await d.expect(DecodeRequest)
            good_p = ps[1 - ps.index(bad_p)]
            assert (req.rid, req.prefill_node_id, list(req.prompt_ids)) == ("r1~1", good_p.node_id, PROMPT)
            d.send(Reserved("r1~1", "x2", (5, 6), 0))
            assert (await good_p.expect(PrefillRequest)).xfer_id == "x2"
            good_p.send(FirstToken("r1~1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1~1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            assert counter(c.backend.collectors()[0]) == 1      # retries
    run(test)


def test_retries_are_bounded():
    """With max_retries = 1 a request whose prefill fails twice raises RuntimeError after 2 attempts."""
    async def test():
        async with Cluster(dataclasses.replace(CONFIG, max_retries=1)) as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate()
            for rid in ("r1", "r1~1"):
                await d.expect(DecodeRequest)
                d.send(Reserved(rid, "x1", (3, 4), 0))
                await p.expect(PrefillRequest)
                p.send(RequestFailed(rid, "out of memory", True))
                assert (await d.expect(AbortRequest)).rid == rid
                assert (await p.expect(AbortRequest)).rid == rid
            err = await out.next()
            assert isinstance(err, RuntimeError) and "after 2 attempts" in str(err)
            await d.assert_silent()
    run(test)


def test_non_retryable_failure_before_any_token_is_a_rejection():
    """A node's non-retryable RequestFailed before any output raises ValueError (HTTP 400)."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            d = await c.node("decode-0", "decode")
            out = c.generate()
            await d.expect(DecodeRequest)
            d.send(RequestFailed("r1", "prompt needs more blocks than the pool has", False))
            err = await out.next()
            assert isinstance(err, ValueError) and "more blocks" in str(err)
    run(test)


@pytest.mark.parametrize("death", ["heartbeat", "new_epoch"])
def test_decode_death_mid_stream_migrates_without_losing_or_repeating_tokens(death):
    """D dies after 3 tokens: a new request with prompt + those tokens and max/min_tokens less 3
    runs on the other D, and the client's stream continues exactly where it was."""
    async def test():
        async with Cluster() as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=8, min_tokens=4)
            dead, _ = await first_of(ds, DecodeRequest)
            dead.send(Reserved("r1", "x1", (3, 4), 0))
            await p.expect(PrefillRequest)
            seen = []
            for sender, msg in ((p, FirstToken("r1", 11, "a", None, "")),
                                (dead, TokenDelta("r1", 0, (11, 12), 0, "ab", None, "")),
                                (dead, TokenDelta("r1", 2, (13,), 2, "c", None, ""))):
                sender.send(msg)
                seen.append(view(await out.next()))
            assert seen[-1] == ([([11, 12, 13], "abc", None)], False)
            if death == "heartbeat":
                dead.die()
            else:
                await dead.hello(epoch="e2")
            live = ds[1 - ds.index(dead)]
            req = await live.expect(DecodeRequest, timeout=3.0)
            assert (req.rid, list(req.prompt_ids)) == ("r1~1", PROMPT + [11, 12, 13])
            assert (req.params.max_tokens, req.params.min_tokens) == (5, 1)
            assert (await p.expect(AbortRequest)).rid == "r1"   # it may still be shipping to the dead D
            live.send(Reserved("r1~1", "x2", (7, 8), 0))
            pre = await p.expect(PrefillRequest)
            assert (pre.rid, pre.kv_endpoint) == ("r1~1", live.kv_endpoint)
            p.send(FirstToken("r1~1", 14, "d", None, ""))
            live.send(TokenDelta("r1~1", 0, (14, 15), 0, "de", None, ""))
            live.send(TokenDelta("r1~1", 2, (16,), 2, "f", None, "stop"))
            while (final := await out.next()) is not _END and not final.finished:
                seen.append(view(final))
            seen.append(view(final))
            assert seen[-1] == ([([11, 12, 13, 14, 15, 16], "abcdef", "stop")], True)
            for (before, _), (after, _) in zip(seen, seen[1:]):      # each output extends the last
                assert after[0][0][:len(before[0][0])] == before[0][0]
                assert after[0][1].startswith(before[0][1])
            assert counter(c.backend.collectors()[1]) == 1      # migrations
            if death == "new_epoch":    # the restarted node is told to drop the old attempt
                assert (await dead.expect(AbortRequest)).rid == "r1"
    run(test)


def test_decode_death_after_the_last_token_finishes_with_length():
    """D lost after sending all max_tokens tokens but no finish: the choice ends 'length', unmigrated."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate(max_tokens=2)
            await _admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, ""))
            assert view(await out.next()) == ([([11, 12], "ab", None)], False)
            d.die()
            assert view(await out.next(timeout=3.0)) == ([([11, 12], "ab", "length")], True)
            assert counter(c.backend.collectors()[1]) == 0      # nothing was left to migrate
    run(test)


def test_prefill_death_after_first_token_changes_nothing():
    """P lost after its FirstToken: D goes on and the request completes on the same attempt."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate(max_tokens=2)
            await _admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            await out.next()
            p.die()
            await _until(lambda: not c.backend.server.count(NodeRole.PREFILL))
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            await d.assert_silent()
    run(test)


# ------------------------------------------------------------------ aborts


@pytest.mark.parametrize("how", ["aclose", "abort", "cancel"])
def test_client_abort_reaches_both_nodes(how):
    """Closing the stream, abort(rid) or cancelling the consumer sends AbortRequest to P and D."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            stream = c.backend.generate("r1", PROMPT, SamplingParams(max_tokens=8))
            out = Consumer(stream)
            await _admit(d, p)
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            if how == "abort":
                await c.backend.abort("r1")
                assert await out.next() is _END         # stops without a finished output
            elif how == "cancel":
                out.task.cancel()
            else:
                out.task.cancel()
                await asyncio.gather(out.task, return_exceptions=True)
                await stream.aclose()
            assert (await p.expect(AbortRequest)).rid == "r1"
            assert (await d.expect(AbortRequest)).rid == "r1"
            assert [n.inflight_requests for n in c.backend.server.registry.nodes()] == [0, 0]
    run(test)


def test_request_id_is_free_again_after_abort():
    """After abort(rid) the id may be reused at once, and the old stream's cleanup leaves the new one be."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            old = c.generate()
            await d.expect(DecodeRequest)
            await c.backend.abort("r1")
            await d.expect(AbortRequest)
            new = c.generate(max_tokens=1)
            assert await old.next() is _END
            await _admit(d, p)
            p.send(FirstToken("r1", 4, "x", None, "length"))
            assert view(await new.next()) == ([([4], "x", "length")], True)
    run(test)


def test_abort_before_reservation_reaches_only_decode_node():
    """An abort while D has not answered: D gets AbortRequest; P, never asked, gets nothing."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            out = c.generate()
            await d.expect(DecodeRequest)
            await c.backend.abort("r1")
            assert (await d.expect(AbortRequest)).rid == "r1"
            d.send(Reserved("r1", "x1", (3, 4), 0))     # too late: dropped as stray
            await p.assert_silent()
            assert await out.next() is _END
    run(test)


# ------------------------------------------------------------------ the control plane


def test_garbage_frames_are_dropped_and_counted_while_a_request_completes():
    """Malformed, unexpected, unregistered and stray frames are dropped without harm to live work."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            rogue = c.ctx.socket(zmq.DEALER)
            rogue.setsockopt(zmq.IDENTITY, b"rogue")
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(c.backend.control_endpoint)
            out = c.generate(max_tokens=2)
            await _admit(d, p)
            for junk in (b"", b"\xc1", b"\x93\x01\xa3bad\x90", control.encode(NodeCommand("ok"))[:-1]):
                p.sock.send(junk)
            p.sock.send_multipart([b"two", b"frames"])
            rogue.send(control.encode(FirstToken("r1", 99, "evil", None, "stop")))
            p.send(NodeCommand("leave"))                                # a router-to-node kind
            p.send(FirstToken("nobody", 1, "x", None, ""))              # no such request
            p.send(FirstToken("r1", 11, "a", None, ""))
            assert view(await out.next()) == ([([11], "a", None)], False)
            d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
            assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
            dropped = c.backend.server.dropped
            assert {r: counter(dropped, {"reason": r}) for r in ("malformed", "unexpected", "unknown_node",
                                                               "stray")} == \
                {"malformed": 5, "unexpected": 1, "unknown_node": 1, "stray": 1}
            assert c.backend.is_healthy()
            rogue.close(0)
    run(test)


def test_heartbeat_expiry_removes_a_node():
    """A node silent for heartbeat_timeout_s leaves metrics and health; its next status gets 'register'."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            d.kv_usage = 0.5
            await asyncio.sleep(3 * BEAT_S)
            assert c.backend.is_healthy()
            metrics = {m.node_id: m for m in c.backend.metrics()}
            assert (metrics["decode-0"].role, metrics["decode-0"].kv_usage,
                    metrics["decode-0"].num_running, metrics["decode-0"].num_preemptions) == ("decode", 0.5, 1, 2)
            d.stop_heartbeat()
            await _until(lambda: [m.node_id for m in c.backend.metrics()] == ["prefill-0"], timeout=2.0)
            assert not c.backend.is_healthy()
            d.send(NodeStatus("decode-0", "e1", 0, 0, 0.0, 0.0, 0, 10))
            await _until(lambda: d.commands[-1] == "register")
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
            await _until(lambda: d.commands[-1] == "register")
    run(test)


def test_node_with_another_block_size_is_refused():
    """A node whose block size differs from the registered nodes' is told to leave, not registered."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill")
            odd = ScriptedNode(c.ctx, c.backend.control_endpoint, "decode-9", "decode")
            c.nodes["decode-9"] = odd
            odd._tasks = [asyncio.create_task(odd._read())]
            await odd.hello(block_size=2 * BLOCK)
            assert odd.commands == ["leave"]
            assert c.backend.server.count(NodeRole.DECODE) == 0
    run(test)


def test_max_model_len_is_the_smallest_of_model_and_nodes():
    """max_model_len comes from the model folder, lowered by what the nodes can hold."""
    async def test():
        async with Cluster() as c:
            assert c.backend.max_model_len == 256
            node = await c.node("prefill-0", "prefill")
            node.send(NodeHello("prefill-0", "e1", "prefill", "", 64, BLOCK, 100))
            await _until(lambda: c.backend.max_model_len == 100)
    run(test)


# ------------------------------------------------------------------ rejections and metrics


def test_rejections_raise_value_error_before_anything_is_sent():
    """Empty or too long a prompt, bad token ids and duplicate ids raise ValueError; nodes hear nothing."""
    async def test():
        async with Cluster() as c:
            p, d = await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            first = c.generate("dup")
            await d.expect(DecodeRequest)
            for rid, prompt in (("a", []), ("b", [1] * 256), ("c", [512]), ("dup", PROMPT)):
                err = await c.generate(rid, prompt).next()
                assert isinstance(err, ValueError), (rid, err)
            await d.assert_silent(), await p.assert_silent()
            await c.backend.abort("dup")
            assert await first.next() is _END
    run(test)


def test_no_nodes_is_no_node_available_at_once():
    """A fresh request with no live nodes fails with NoNodeAvailable (HTTP 503) without waiting."""
    async def test():
        async with Cluster() as c:
            loop = asyncio.get_running_loop()
            start = loop.time()
            err = await c.generate().next()
            assert isinstance(err, NoNodeAvailable) and loop.time() - start < 1.0
    run(test)


def test_prometheus_exposes_router_counters_and_nodes():
    """/metrics shows each node's gauges and the router's retry, migration, busy and drop counters."""
    async def test():
        async with Cluster() as c:
            await c.node("prefill-0", "prefill"), await c.node("decode-0", "decode")
            await asyncio.sleep(2 * BEAT_S)
            text = RouterMetrics(c.backend).render().decode()
            for series in ("pdserve_router_retries_total", "pdserve_router_migrations_total",
                           "pdserve_router_busy_replies_total",
                           'pdserve_num_requests_running{node="decode-0",role="decode"} 1.0'):
                assert series in text
    run(test)
