"""KV moves over real node processes on this machine: a drained decode node's running streams move
to the other decode node with their KV blocks (router/cluster/kv_move.py, decode_node/mover.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
import time
from typing import Callable

import pytest

from engine.builtin import BUILTIN_MODEL_PATH
from pdwire.sampling_params import SamplingParams
from router.config import RouterConfig
from router.node_processes import ClusterConfig
from tests.model_factory import hf_greedy
from tests.router.test_router_disagg_e2e import PROMPTS, _collect, _prefills, _with_cluster
from tests.router.test_router_operator import admin_client, membership
from tests.router.test_router_operator_e2e import _until

# every prompt through the prefill node, so a re-prefill would show in its count; a move gets 30 s, not
# the default 5 (the take-out waits twice that for the moves): these tests assert every stream moved
# with its KV blocks, and under the full suite's load fresh clones re-prefilled 2 of 4 streams (session
# 21: a pause plus a reservation past 5 s) and 6 of 6 (session 22: every stream shipped, then the
# take-out's 10 s ran out before the new node's first token). The fallback test sets its own.
CONFIG = RouterConfig(heartbeat_timeout_s=30.0, routing="affinity", kv_move_timeout_s=30.0)
# streams long enough to be mid-generation whenever the drain lands (on a loaded machine the
# router's view of a stream may lag the nodes by many tokens), and blocks for all of them on one node
STREAMS, MAX_TOKENS = 4, 400
ROOM = ["--num-blocks", "256"]
TEXTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not",
         "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed", "MACBETH:\nIs this a dagger"]


# Lets the decode nodes (argv[2:]) run for argv[1] s each time it reads a line, then holds them and
# answers "held". A process of its own, asleep between lines, at a real-time priority where it may
# (root, as in CI): it wakes on time, where a thread of the router's process waited for the loop's
# thread to drop the GIL (0.34 s once, a second suite's tests and four busy loops beside it), a shell
# spawned each time waited to be scheduled (0.4 s), and this process at the normal priority 0.24 s.
PACER = """
import os, signal, sys, time
run_s, pids = float(sys.argv[1]), [int(p) for p in sys.argv[2:]]
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
except PermissionError:
    pass
for _ in sys.stdin:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    time.sleep(run_s)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    sys.stdout.write("held\\n")
    sys.stdout.flush()
"""


class DrainMidStream:
    """Steps the decode nodes until every stream is decoding, then takes one out mid-stream.

    The test model decodes 400 tokens in ~0.4 s, less than a loaded machine may delay a stream's
    KV shipment or deschedule the router (CI of session 32's submission: two streams adopted 0.35 s
    after the other two, the router's view 0.3 s behind the nodes; one stream ended before another
    had its 2nd token, where the nodes were held only once the router saw every stream decoding).
    So the nodes never run unwatched: from before the first stream is sent, every decode node is
    held (SIGSTOP) but for RUN_S at a time (the pacer), and the router's view is read only while
    they are held, once it has merged what they sent. Once every stream is on a decode node and
    every unfinished one has at_tokens tokens, the decode node with the most unfinished streams (of
    two alike, the one whose streams have the fewest tokens) is drained (deadline ~0) while held,
    and the nodes go on: its streams are mid-generation whatever the load. take_out(node), when
    given, acts on the node instead of the drain."""

    RUN_S = 0.02        # each step: a few tokens of the test model (~1 ms a step unloaded)

    def __init__(self, backend, nodes, rids: list[str], at_tokens: int,
                 take_out: Callable[[str], None] | None = None):
        self.backend, self.at_tokens = backend, at_tokens
        self.take_out = take_out or (lambda node: backend.operator.drain(node, deadline_s=0.001))
        self.processes = {n.node_id: n.process for n in nodes if n.node_id.startswith("decode")}
        self.counts = dict.fromkeys(rids, 0)
        self.finished: set[str] = set()
        self.node: str | None = None
        self.moved: set[str] = set()         # the streams unfinished on that node then
        self.seen: dict[str, tuple[str, int]] = {}  # each unfinished stream's node and tokens then (for a failure's message)
        self.log: list[tuple] = []          # each step's view and each run's wall time (for a failure's message)
        self.pacer: subprocess.Popen | None = None
        self.task = asyncio.get_running_loop().create_task(self._step())

    def watch(self, rid: str):
        def on_output(out) -> None:
            self.counts[rid] = len(out.outputs[0].token_ids)
            if out.finished:
                self.finished.add(rid)
        return on_output

    def _state(self) -> dict:
        """Each stream's (prefill node, decode node) and tokens (for a failure's message)."""
        return {r: (self.backend.placement(r), n) for r, n in self.counts.items()}

    def _signal(self, sig: signal.Signals) -> None:
        for process in self.processes.values():
            process.send_signal(sig)

    def _run(self) -> None:
        """Lets the nodes run for RUN_S (PACER): a thread's call, blocking until they are held."""
        t0 = time.monotonic()
        self.pacer.stdin.write(b"run\n")
        self.pacer.stdin.flush()
        assert self.pacer.stdout.readline() == b"held\n", "the pacer ended"
        self.log.append(("run", round(t0, 3), round(time.monotonic() - t0, 3)))

    def _ready(self) -> bool:
        """Every stream is on a decode node and every unfinished one has at_tokens tokens."""
        placed = [self.backend.placement(r) for r in self.counts]
        return all(p and p[0][1] in self.processes for p in placed) and \
            all(n >= self.at_tokens for r, n in self.counts.items() if r not in self.finished)

    async def _step(self) -> None:
        pids = [str(p.pid) for p in self.processes.values()]
        self.pacer = subprocess.Popen([sys.executable, "-c", PACER, str(self.RUN_S), *pids],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            self._signal(signal.SIGSTOP)
            while True:
                self.log.append((round(asyncio.get_running_loop().time(), 3), self._state()))
                await self._caught_up(quiet_s=0.05)
                if self._ready():
                    break
                assert not self.finished, f"a stream ended before the drain: {self.log}"
                await asyncio.to_thread(self._run)
            await self._caught_up()
            where = {r: self.backend.placement(r)[0][1] for r in self.counts if r not in self.finished}
            assert where, f"every stream finished before the drain: {self.counts}"
            self.node = max(sorted(set(where.values())), key=lambda node: (
                list(where.values()).count(node), -min(self.counts[r] for r, n in where.items() if n == node)))
            self.moved = {r for r, node in where.items() if node == self.node}
            self.seen = {r: (node, self.counts[r]) for r, node in where.items()}
            self.take_out(self.node)
            operator, server = self.backend.operator, self.backend.server
            # the take-out has begun: its PauseRequests are sent to the held node (or it is out)
            await _until(lambda: self.node in operator._evacuating or server.info(self.node) is None)
        finally:
            self.pacer.kill()
            self.pacer.wait()
            self.pacer.stdin.close()
            self.pacer.stdout.close()
            self._signal(signal.SIGCONT)

    async def _caught_up(self, quiet_s: float = 0.3, timeout_s: float = 30.0) -> None:
        """Returns once no stream has changed for quiet_s: the router has merged all the held
        nodes sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            seen = (dict(self.counts), set(self.finished))
            await asyncio.sleep(quiet_s)
            if seen == (self.counts, self.finished):
                return


async def _warm(backend) -> None:
    """One short request on each decode node at once (the second is booked on the other node):
    both transfer paths are paired before the streams start, so the streams start together."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    await asyncio.gather(*(_collect(backend, f"warm{i}", PROMPTS[1], params) for i in range(2)))


def _migrations(backend) -> dict[str, float]:
    return {k: v for k, v in membership(backend).items() if k.startswith("pdserve_router_migrations_total")}


async def _all_blocks_free(backend) -> None:
    await _until(lambda: all(v.num_free_blocks == v.num_blocks and v.num_running == 0
                             for v in backend.operator.nodes()))


@pytest.mark.parametrize("transport", ["zmq", "torch_dist"])
def test_drain_deadline_moves_running_streams_with_their_kv_blocks(model_dir, transport):
    """4 greedy streams on 2 decode nodes; one node drained with a ~0 deadline mid-stream: its
    running streams move with their KV blocks, over ZeroMQ or gloo pair groups (counted as kv_move,
    none re-prefilled: the prefill node prefilled exactly the 4 prompts and 2 warm-ups), every
    stream still equals transformers' greedy (float32), the drained node exits 0, and every
    surviving node ends with every block free."""
    path, hf_model = model_dir

    async def test(backend, nodes):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        await _warm(backend)
        rids, prompts = [f"s{i}" for i in range(STREAMS)], [PROMPTS[i % 2] for i in range(STREAMS)]
        drain = DrainMidStream(backend, nodes, rids, 4)
        outs = await asyncio.gather(*(_collect(backend, rid, p, params, drain.watch(rid))
                                      for rid, p in zip(rids, prompts)))
        await drain.task
        expected = {i: hf_greedy(hf_model, PROMPTS[i], MAX_TOKENS) for i in (0, 1)}
        for i, out in enumerate(outs):
            assert out.finished and out.outputs[0].finish_reason == "length"
            assert list(out.outputs[0].token_ids) == expected[i % 2]
        moved = _migrations(backend)
        # with their KV blocks, never re-prefilled
        assert list(moved) == ['pdserve_router_migrations_total{cause="drained",how="kv_move"}'], (moved, drain.seen)
        assert 1 <= sum(moved.values()) <= len(drain.moved)
        assert _prefills(backend) == {"remote": STREAMS + 2}       # + the warm-ups
        node = next(n for n in nodes if n.node_id == drain.node)
        await _until(lambda: node.process.poll() is not None)
        assert node.process.returncode == 0
        await _all_blocks_free(backend)
    _with_cluster(path, CONFIG, ClusterConfig(1, 2), test, ["--kv-transport", transport, *ROOM])


def test_a_remove_is_answered_once_the_node_is_out_after_its_streams_moved_with_their_kv_blocks(model_dir):
    """POST /admin/nodes/{id}/remove mid-stream on the decode node serving the most streams: the
    answer ("removed") comes only once the node is out: no longer listed, lost as removed, its
    streams moved with their KV blocks (none re-prefilled); every stream equals transformers'
    greedy (float32) and the removed node process exits 0."""
    path, hf_model = model_dir

    async def test(backend, nodes):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        await _warm(backend)
        rids = [f"s{i}" for i in range(STREAMS)]
        answer: dict = {}
        # the app is made before the streams start: building it (and importing FastAPI, the first
        # time in a process) inside the callback held the loop while the node finished its streams
        http = admin_client(backend)

        async def remove(node: str) -> None:
            reply = await http.post(f"/admin/nodes/{node}/remove")
            answer.update(reply=reply, listed=[v.id for v in backend.operator.nodes()], seen=membership(backend))
        posted: list[asyncio.Task] = []
        drain = DrainMidStream(backend, nodes, rids, 4, lambda node: posted.append(asyncio.create_task(remove(node))))
        async with http:
            outs = await asyncio.gather(*(_collect(backend, rid, PROMPTS[0], params, drain.watch(rid))
                                          for rid in rids))
            await drain.task
            await posted[0]
        assert (answer["reply"].status_code, answer["reply"].json()["state"]) == (200, "removed")
        assert drain.node not in answer["listed"]
        seen = answer["seen"]
        assert seen['pdserve_router_node_losses_total{cause="removed"}'] == 1
        # moved with their KV blocks, never re-prefilled
        assert 1 <= seen['pdserve_router_migrations_total{cause="removed",how="kv_move"}'] <= len(drain.moved)
        assert 'pdserve_router_migrations_total{cause="removed",how="reprefill"}' not in seen
        assert _migrations(backend) == {k: v for k, v in seen.items() if k.startswith("pdserve_router_migrations")}
        expected = hf_greedy(hf_model, PROMPTS[0], MAX_TOKENS)
        assert all(list(out.outputs[0].token_ids) == expected for out in outs)
        node = next(n for n in nodes if n.node_id == drain.node)
        await _until(lambda: node.process.poll() is not None)
        assert node.process.returncode == 0
        await _all_blocks_free(backend)
    _with_cluster(path, CONFIG, ClusterConfig(1, 2), test, ROOM)


def test_a_failed_kv_move_falls_back_to_re_prefilling(model_dir):
    """No pause can be answered within a kv_move_timeout_s of 1 µs: the streams of the drained
    node move re-prefilled instead (counted as reprefill, one more prefill each), still equal to
    transformers' greedy, and every surviving node ends with every block free."""
    path, hf_model = model_dir

    async def test(backend, nodes):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        await _warm(backend)
        rids = [f"s{i}" for i in range(STREAMS)]
        drain = DrainMidStream(backend, nodes, rids, 4)
        outs = await asyncio.gather(*(_collect(backend, rid, PROMPTS[0], params, drain.watch(rid)) for rid in rids))
        await drain.task
        expected = hf_greedy(hf_model, PROMPTS[0], MAX_TOKENS)
        for out in outs:
            assert list(out.outputs[0].token_ids) == expected
        moved = _migrations(backend)
        assert list(moved) == ['pdserve_router_migrations_total{cause="drained",how="reprefill"}'], moved
        assert 1 <= sum(moved.values()) <= len(drain.moved)
        assert _prefills(backend) == {"remote": STREAMS + 2 + sum(moved.values())}
        await _all_blocks_free(backend)
    _with_cluster(path, dataclasses.replace(CONFIG, kv_move_timeout_s=1e-6), ClusterConfig(1, 2), test, ROOM)


def test_greedy_streams_moved_in_bfloat16_equal_them_unmoved():
    """bfloat16 on the built-in model, where a re-prefilled K/V differs from the decoded one (a
    re-prefill move changed 1 of these 6 streams in a run of this test with kv_move_timeout_s at
    1 µs): 6 greedy streams, the decode node serving most of them drained once all have 40
    tokens; every stream moved with its KV blocks gives exactly the token ids, text and logprobs it gives unmoved
    (prefix caching off: the same K/V bytes either way)."""
    flags = ["--dtype", "bfloat16", "--no-enable-prefix-caching", *ROOM]     # after NODE_FLAGS' float32

    async def test(backend, nodes):
        params = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True, logprobs=1)
        unmoved = await asyncio.gather(*(_collect(backend, f"u{i}", t, params) for i, t in enumerate(TEXTS)))
        await _warm(backend)
        rids = [f"m{i}" for i in range(len(TEXTS))]
        drain = DrainMidStream(backend, nodes, rids, 40)
        moved = await asyncio.gather(*(_collect(backend, rid, t, params, drain.watch(rid))
                                       for rid, t in zip(rids, TEXTS)))
        await drain.task
        kv_moves = _migrations(backend)
        assert list(kv_moves) == ['pdserve_router_migrations_total{cause="drained",how="kv_move"}'], kv_moves
        for a, b in zip(unmoved, moved):
            assert len(b.outputs[0].token_ids) == 320
            assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids), b.request_id
            assert (b.outputs[0].text, list(b.outputs[0].logprobs)) == (a.outputs[0].text, list(a.outputs[0].logprobs))
        await _all_blocks_free(backend)
    _with_cluster(BUILTIN_MODEL_PATH, CONFIG, ClusterConfig(1, 2), test, flags)
