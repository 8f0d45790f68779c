"""ColocatedBackend: the engine on its own thread, against a scripted fake engine (over HTTP with a
real engine: test_router_colocated_engine.py)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from pdwire.figures import PrefixCounters
from pdwire.outputs import CompletionOutput, RequestOutput
from pdwire.sampling_params import SamplingParams
from router.backend import NodeMetrics
from router.colocated import ColocatedBackend
from router.backend import NoNodeAvailable


@dataclass
class _Metrics:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    num_total_blocks: int = 512
    block_size: int = 16
    prefix_queried_tokens: int = 96
    prefix_hit_tokens: int = 32


class FakeEngine:
    """Generates token 7 once per step until max_tokens; records the thread of every call."""

    tokenizer = None
    model_name = "fake"
    max_model_len = 128
    sampler = SimpleNamespace(grammars=None)     # no structured output asked: no compiler made

    def __init__(self, crash_at_steps: tuple[int, ...] = (), fatal_steps: tuple[int, ...] = ()):
        self.running: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.steps = 0
        self.crash_at_steps, self.fatal_steps = crash_at_steps + fatal_steps, fatal_steps

    def safe_step(self):
        """LLMEngine.safe_step's contract: a crash at a step listed in `crash_at_steps` fails the
        requests held; one in `fatal_steps` raises (the engine is broken)."""
        try:
            return self.step(), {}
        except RuntimeError as err:
            if self.steps in self.fatal_steps:
                raise
            failed = list(self.running)
            for rid in failed:
                self.abort_request(rid)
            return [], dict.fromkeys(failed, f"engine step failed: RuntimeError: {err}")

    def add_request(self, request_id, prompt, params):
        self.threads.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt is empty")
        self.running[request_id] = (list(prompt), params, [])

    def abort_request(self, request_id):
        self.threads.add(threading.get_ident())
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.steps in self.crash_at_steps:
            raise RuntimeError("CUDA fell over")
        time.sleep(0.001)
        outs = []
        for rid, (prompt, params, generated) in list(self.running.items()):
            generated.append(7)
            done = len(generated) >= params.max_tokens
            outs.append(RequestOutput(rid, prompt, [CompletionOutput(0, "x" * len(generated), list(generated), None,
                                                          "length" if done else None)], done))
            if done:
                del self.running[rid]
        return outs

    def metrics(self):
        self.threads.add(threading.get_ident())
        return _Metrics(len(self.running), 0, 0.5, 0.25, 1)


@pytest.fixture
def engine_and_backend():
    engine = FakeEngine()
    backend = ColocatedBackend(engine)
    yield engine, backend
    backend.close()


HANG_S = 120.0      # only bounds a hang: a starved 2-core machine is slow, never this slow


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


async def collect(backend, rid, prompt, params):
    return [out async for out in backend.generate(rid, prompt, params)]


def test_generate_streams_deltas(engine_and_backend):
    """generate() yields each step's delta of the engine's cumulative output and ends on the finished one."""
    engine, backend = engine_and_backend
    outs = run(collect(backend, "r1", [1, 2], SamplingParams(max_tokens=3)))
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == [([7], "x"), ([7], "x"), ([7], "x")]
    assert [o.finished for o in outs] == [False, False, True]
    assert engine.aborted == []


def test_engine_runs_on_one_thread_off_the_loop(engine_and_backend):
    """Every engine call after construction happens on the backend's own thread."""
    engine, backend = engine_and_backend
    engine.threads.clear()

    async def two():
        await asyncio.gather(collect(backend, "a", [1], SamplingParams(max_tokens=2)),
                             collect(backend, "b", [1], SamplingParams(max_tokens=4)))
        return threading.get_ident()

    loop_thread = run(two())
    assert len(engine.threads) == 1 and loop_thread not in engine.threads


def test_rejection_raises_value_error_first(engine_and_backend):
    """An engine ValueError surfaces at the first await of generate(), and the loop survives."""
    _, backend = engine_and_backend
    with pytest.raises(ValueError, match="prompt is empty"):
        run(collect(backend, "r1", [], SamplingParams()))
    assert len(run(collect(backend, "r2", [1], SamplingParams(max_tokens=1)))) == 1


def test_duplicate_request_id_rejected(engine_and_backend):
    """A request id already running is refused with ValueError."""
    _, backend = engine_and_backend

    async def dup():
        first = backend.generate("r1", [1], SamplingParams(max_tokens=1000))
        await anext(first)
        try:
            with pytest.raises(ValueError, match="duplicate"):
                await collect(backend, "r1", [1], SamplingParams(max_tokens=1))
        finally:
            await first.aclose()

    run(dup())


def test_closing_generator_aborts(engine_and_backend):
    """Leaving generate() early (break / aclose / cancel) aborts the request in the engine."""
    engine, backend = engine_and_backend

    async def leave_early():
        async for _ in backend.generate("r1", [1], SamplingParams(max_tokens=1000)):
            break
        task = asyncio.create_task(collect(backend, "r2", [1], SamplingParams(max_tokens=1000)))
        while "r2" not in engine.running:       # the engine thread has it (run() bounds the waits)
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while len(engine.aborted) < 2:
            await asyncio.sleep(0.005)

    run(leave_early())
    assert sorted(engine.aborted) == ["r1", "r2"] and not engine.running


def test_abort_ends_the_stream(engine_and_backend):
    """abort() from outside aborts in the engine and ends generate() without a finished output."""
    engine, backend = engine_and_backend

    async def abort_midway():
        outs = []
        async for out in backend.generate("r1", [1], SamplingParams(max_tokens=1000)):
            outs.append(out)
            if len(outs) == 2:
                await backend.abort("r1")
        return outs

    outs = run(abort_midway())
    assert not outs[-1].finished and engine.aborted == ["r1"]


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on():
    """A step the engine fails (safe_step) fails the requests it held with RuntimeError and the
    next request is served; a step that raises (a broken engine) makes the backend unhealthy
    and refuse work."""
    engine = FakeEngine(crash_at_steps=(2,), fatal_steps=(4,))
    backend = ColocatedBackend(engine)
    with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: CUDA fell over"):
        run(collect(backend, "r1", [1], SamplingParams(max_tokens=10)))
    assert backend.is_healthy() and engine.aborted == ["r1"]
    assert run(collect(backend, "r2", [1], SamplingParams(max_tokens=1)))[-1].finished     # step 3
    with pytest.raises(RuntimeError, match="CUDA fell over"):                 # step 4: fatal
        run(collect(backend, "r3", [1], SamplingParams(max_tokens=10)))
    assert not backend.is_healthy()
    with pytest.raises(NoNodeAvailable, match="not running"):
        run(collect(backend, "r4", [1], SamplingParams(max_tokens=1)))


def test_metrics_snapshot_and_close(engine_and_backend):
    """metrics() returns the engine thread's latest snapshot; close() stops the thread."""
    _, backend = engine_and_backend
    assert backend.metrics() == [NodeMetrics("colocated", "colocated", 0, 0, 0.5, 0.25, 1, (),
                                             PrefixCounters(96, 32), 16, 512)]
    backend.close()
    backend.close()
    assert not backend.is_healthy()
