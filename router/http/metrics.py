"""Prometheus metrics of one app instance: its own CollectorRegistry, nothing global.

Request-level series are observed by the app as outputs arrive, each labelled with the model
(`model_name`, as vLLM's). Per request, from these timestamps (router clock unless noted):

    arrival ──queue──▶ scheduled ──prefill──▶ first token ──decode──▶ last token
       │                (backend's queue_time)     │                      │
       └──────────── TTFT ─────────────────────────┘                      │
       └──────────────────────────── e2e ─────────────────────────────────┘

queue = the backend's RequestOutput.queue_time (colocated: the engine's wait for its first
admission; disaggregated: arrival until a decode node reserved blocks), prefill = TTFT - queue,
decode = last token - first token. Node-level series come from router/cluster/node_collector.py; a
backend adds its own (e.g. KV transfer time) through Backend.collectors(). The process's CPU and
memory (process_*) are on the same registry; no `*_created` series are rendered.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import Metric

from router.backend import Backend
from router.cluster.node_collector import NodeCollector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


def token_buckets(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > most:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class RouterMetrics:
    def __init__(self, backend: Backend, clock: Callable[[], float] = time.perf_counter):
        self.registry = CollectorRegistry(auto_describe=True)
        self.clock = clock
        self.model = backend.model_name
        self.ttft = self._seconds("pdserve_time_to_first_token_seconds", "Time to first token.")
        self.itl = self._seconds("pdserve_inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = self._seconds("pdserve_e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = self._seconds("pdserve_request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = self._seconds("pdserve_request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = self._seconds("pdserve_request_decode_time_seconds", "First token to last token.")
        lengths = token_buckets(backend.max_model_len)
        self.prompt_len = self._histogram("pdserve_request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.generation_len = self._histogram("pdserve_request_generation_tokens",
                                              "Tokens generated per request (all choices).", lengths)
        self.success = Counter("pdserve_request_success", "Finished requests, by finish reason.",
                               ["model_name", "finish_reason"], registry=self.registry)
        self.failure = Counter("pdserve_request_failure", "Requests that failed, by cause.",
                               ["model_name", "reason"], registry=self.registry)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted.", ["model_name"],
                                     registry=self.registry).labels(self.model)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=self.registry).labels(self.model)
        ProcessCollector(registry=self.registry)
        self.registry.register(NodeCollector(backend))
        for collector in backend.collectors():
            self.registry.register(collector)

    def _seconds(self, name: str, help_text: str) -> Histogram:
        return self._histogram(name, help_text, LATENCY_BUCKETS)

    def _histogram(self, name: str, help_text: str, buckets: tuple) -> Histogram:
        return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class _WithoutCreated:
    """The registry's metrics less their `*_created` samples (kept per registry: prometheus_client's
    disable_created_metrics() would switch them off for the whole process)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class RequestTracker:
    """Timings of one backend request; feed it every output, then end it once."""

    def __init__(self, metrics: RouterMetrics):
        self._m = metrics
        self._start = self._last = self._first = metrics.clock()
        self._tokens = 0
        self._reasons: list[str] = []   # each choice's finish reason, as its last delta came
        self._ended = False

    def on_output(self, output: Any) -> None:
        """`output` is a delta (router/backend.py): its tokens are new ones."""
        new = sum(len(c.token_ids) for c in output.outputs)
        if new:
            now = self._m.clock()
            if self._tokens == 0:
                self._first = now
                self._on_first_token(now - self._start, output.queue_time)
            else:
                self._m.itl.observe(now - self._last)
            self._m.generation_tokens.inc(new)
            self._tokens, self._last = self._tokens + new, now
        self._reasons += [c.finish_reason for c in output.outputs if c.finish_reason is not None]
        if output.finished and not self._ended:
            self._ended = True
            self._on_finish(output)

    def _on_first_token(self, ttft: float, queue: float | None) -> None:
        self._m.ttft.observe(ttft)
        if queue is not None:
            self._m.queue.observe(queue)
            self._m.prefill.observe(max(0.0, ttft - queue))

    def _on_finish(self, output: Any) -> None:
        m = self._m
        m.e2e.observe(m.clock() - self._start)
        if self._tokens:
            m.decode.observe(self._last - self._first)
        m.prompt_tokens.inc(len(output.prompt_token_ids))
        m.prompt_len.observe(len(output.prompt_token_ids))
        m.generation_len.observe(self._tokens)
        for reason in self._reasons:
            m.success.labels(m.model, reason).inc()

    def fail(self, reason: str) -> None:
        """Counts the request as failed unless it already finished."""
        if not self._ended:
            self._ended = True
            self._m.failure.labels(self._m.model, reason).inc()
