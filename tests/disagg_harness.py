"""Scripted node peers for DisaggregatedBackend tests: test doubles of the node processes that speak
the real control protocol over real ZMQ DEALER sockets, so the router side runs exactly as served."""
from __future__ import annotations

import asyncio
import gc

import uvloop
import zmq
import zmq.asyncio

from pdwire.sampling_params import SamplingParams
from pdwire.control import (DecodeRequest, FirstToken, KVEvents, NodeCommand, NodeHello, NodeStatus,
                            PrefillRequest, TokenDelta)
from pdwire.messages import Reserved
from kvtransport.testing import TEST_SECRET
from kvtransport.zmtp_auth import plain_client
from router.config import RouterConfig
from router.cluster.disaggregated import DisaggregatedBackend
from tests.control_peer import NodeEnd
from tests.deltas import Accumulator


BLOCK = 4
PROMPT = [5, 6, 7, 8, 9, 10]            # 2 blocks of 4
# every prompt through a prefill node (the scripted prompts are short: routing cost would prefill
# them on the decode node); tests of local prefill set local_prefill_tokens
CONFIG = RouterConfig(heartbeat_timeout_s=5.0, admission_timeout_s=5.0, local_prefill_tokens=0)
# for the tests that lose a node by its silence: short enough to be quick, long enough that a loaded
# 2-core CI machine does not lose the live nodes too (0.5 s did, now and then)
LOSSY = RouterConfig(heartbeat_timeout_s=1.0, admission_timeout_s=5.0, local_prefill_tokens=0)
BEAT_S = 0.05
# Waits for a message or a state only bound a hang: a starved 2-core CI machine may take many times
# what it takes here.
HANG_S = 30.0
END = object()


class ScriptedNode:
    """A node process as the router sees it: a DEALER that opens an authenticated session, says
    hello, heartbeats, and answers requests as each test scripts it."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, node_id: str, role: str, epoch: str = "e1"):
        self.node_id, self.role, self.epoch = node_id, role, epoch
        self.kv_endpoint = f"tcp://{node_id}.kv.test:7000" if role == "decode" else ""    # never connected to
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.end = NodeEnd()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.commands: list[str] = []
        self.kv_usage = 0.0
        self.num_running = 1                        # what the heartbeat reports (0: idle)
        self.free_blocks = 64                       # of the 64 its hello announces
        self.kv_counters: tuple[int, ...] = ()      # NodeStatus's KV_COUNTERS the heartbeat reports
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> ScriptedNode:
        await self.connect()
        self._tasks.append(asyncio.create_task(self._beat()))
        await self.hello()
        return self

    async def connect(self) -> None:
        """Reads the router's messages from now on and opens the authenticated session."""
        self._tasks = [asyncio.create_task(self._read())]
        self.sock.send_multipart(self.end.hello())
        await until(lambda: self.end.session is not None)

    async def hello(self, epoch: str | None = None, block_size: int = BLOCK) -> None:
        self.epoch = epoch or self.epoch
        before = len(self.commands)
        self.send(NodeHello(self.node_id, self.epoch, self.role, self.kv_endpoint, 64, block_size, 256))
        await until(lambda: len(self.commands) > before)

    def send(self, msg) -> None:
        self.sock.send_multipart(self.end.seal(msg))

    async def expect(self, cls: type, timeout: float = HANG_S):
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
            msg = self.end.receive(await self.sock.recv_multipart())
            if msg is None:
                continue
            if isinstance(msg, NodeCommand):
                self.commands.append(msg.command)
            else:
                self.inbox.put_nowait(msg)

    async def _beat(self) -> None:
        while True:
            self.send(NodeStatus(self.node_id, self.epoch, self.num_running, 0, self.kv_usage, 0.25, 2, self.free_blocks,
                                        *self.kv_counters))
            await asyncio.sleep(BEAT_S)


class Consumer:
    """Iterates a generate() stream on its own task, as the HTTP app does; next() gives the whole
    output so far after each delta (the deltas themselves are kept in `deltas`)."""

    def __init__(self, stream):
        self.stream = stream
        self.items: asyncio.Queue = asyncio.Queue()
        self.deltas: list = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        whole = Accumulator()
        try:
            async for output in self.stream:
                self.deltas.append(output)
                self.items.put_nowait(whole.add(output))
            self.items.put_nowait(END)
        except Exception as err:    # noqa: BLE001 -- the test asserts on it
            self.items.put_nowait(err)

    async def next(self, timeout: float = HANG_S):
        return await asyncio.wait_for(self.items.get(), timeout)


class Cluster:
    """A started backend with scripted nodes; closes everything on exit."""

    def __init__(self, config: RouterConfig = CONFIG):
        self.backend = DisaggregatedBackend(None, "test-model", 256, TEST_SECRET, config, vocab_size=512)
        self.ctx = zmq.asyncio.Context()
        plain_client(self.ctx, TEST_SECRET)     # every peer passes ZMTP PLAIN: the tests aim past it
        self.nodes: dict[str, ScriptedNode] = {}
        self.removals: list[asyncio.Task] = []      # operator removes under way (kept: a task is weakly held)

    def remove(self, node_id: str) -> asyncio.Task:
        """Starts the operator's remove of the node; it answers once the node is out."""
        task = asyncio.create_task(self.backend.operator.remove(node_id))
        self.removals.append(task)
        return task

    async def __aenter__(self) -> Cluster:
        await self.backend.start()
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self._end_removals(failing=exc[0] is not None)
        finally:        # also when a remove failed by itself (raised above)
            self.backend.close()
            for node in self.nodes.values():
                node.die()
            self.ctx.destroy(linger=0)      # also any socket a failed test left open

    async def _end_removals(self, failing: bool) -> None:
        """Cancels the removes still under way and awaits every one, so none is left pending or
        with an exception nobody retrieved; one that failed by itself fails a test that passed."""
        pending = [t for t in self.removals if not t.done()]
        for task in pending:
            task.cancel()
        results = await asyncio.gather(*self.removals, return_exceptions=True)
        errors = [r for t, r in zip(self.removals, results) if t not in pending and isinstance(r, Exception)]
        if errors and not failing:
            raise errors[0]

    async def node(self, node_id: str, role: str, epoch: str = "e1") -> ScriptedNode:
        node = ScriptedNode(self.ctx, self.backend.control_endpoint, node_id, role, epoch)
        self.nodes[node_id] = node
        return await node.start()

    async def pair(self) -> tuple[ScriptedNode, ScriptedNode]:
        """The usual cast: prefill-0 and decode-0, both registered."""
        return await self.node("prefill-0", "prefill"), await self.node("decode-0", "decode")

    def generate(self, rid: str = "r1", prompt=None, **params) -> Consumer:
        params = {"temperature": 0.0, "max_tokens": 8, **params}
        return Consumer(self.backend.generate(rid, PROMPT if prompt is None else prompt,
                                              SamplingParams(**params)))


def run(test, loop: str = "asyncio"):
    """Runs the test on a fresh loop (120 s at most: a hang); fails it if anything reached the loop's
    exception handler (e.g. a task's exception nobody retrieved)."""
    unhandled: list[dict] = []

    async def bounded():
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
        return await asyncio.wait_for(test(), 120)
    result = uvloop.run(bounded()) if loop == "uvloop" else asyncio.run(bounded())
    gc.collect()        # a task in a reference cycle reports its exception when collected
    assert not unhandled, f"unhandled on the loop: {[c.get('exception') or c['message'] for c in unhandled]}"
    return result


async def until(ok, timeout: float = HANG_S) -> None:
    async def poll():
        while not ok():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout)


async def publish_kv(c: Cluster, node: ScriptedNode, hashes, epoch: str | None = None, reset: bool = False) -> None:
    """The node's KV events store `hashes` (of its `epoch`); returns once the router's index has
    them, or has dropped the events."""
    dropped = lambda: counter(c.backend.server.dropped, {"reason": "unexpected"})    # noqa: E731
    before = dropped()
    node.send(KVEvents(node.node_id, epoch or node.epoch, tuple(hashes), (), reset))
    await until(lambda: c.backend.kv_index.size(node.node_id) == len(hashes) or dropped() > before)


async def first_of(nodes: list[ScriptedNode], cls: type, timeout: float = HANG_S):
    """(node, message) from whichever node gets a message first; asserts its type."""
    got: list = []

    def ready() -> bool:
        for node in nodes:
            if not node.inbox.empty():
                got.append((node, node.inbox.get_nowait()))
                return True
        return False
    await until(ready, timeout)
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


async def admit(d: ScriptedNode, p: ScriptedNode, rid: str = "r1", xfer: str = "x1") -> PrefillRequest:
    """D reserves blocks 3 and 4; returns P's PrefillRequest."""
    await d.expect(DecodeRequest)
    d.send(Reserved(rid, xfer, (3, 4), 0))
    return await p.expect(PrefillRequest)


async def serve_two_tokens(c: Cluster, p: ScriptedNode, d: ScriptedNode) -> None:
    """Request r1 through p and d: P's first token 11, then D's 12; the client sees both, in order."""
    out = c.generate(max_tokens=2)
    await admit(d, p)
    p.send(FirstToken("r1", 11, "a", None, ""))
    assert view(await out.next()) == ([([11], "a", None)], False)
    d.send(TokenDelta("r1", 0, (11, 12), 0, "ab", None, "length"))
    assert view(await out.next()) == ([([11, 12], "ab", "length")], True)
