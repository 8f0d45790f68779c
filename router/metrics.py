"""Prometheus metrics of one app instance: its own CollectorRegistry, nothing global.

Request-level series (TTFT, inter-token latency, end-to-end latency, outcomes, tokens) are
observed by the app as outputs arrive; node-level series are read from Backend.metrics() at
scrape time, labelled by node and role, so a disaggregated backend reports each node. A backend
adds its own series (e.g. KV transfer) through Backend.collectors().
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdwire.control import KV_COUNTERS
from router.backend import Backend

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    def __init__(self, backend: Backend, clock: Callable[[], float] = time.perf_counter):
        self.registry = CollectorRegistry(auto_describe=True)
        self.clock = clock
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("pdserve_request_success", "Finished requests, by finish reason.",
                               ["finish_reason"], registry=self.registry)
        self.failure = Counter("pdserve_request_failure", "Requests that failed, by cause.",
                               ["reason"], registry=self.registry)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted.",
                                     registry=self.registry)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated.",
                                         registry=self.registry)
        self.registry.register(_NodeCollector(backend))
        for collector in backend.collectors():
            self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Timings of one backend request; feed it every output, then end it once."""

    def __init__(self, metrics: RouterMetrics):
        self._m = metrics
        self._start = self._last = metrics.clock()
        self._tokens = 0
        self._ended = False

    def on_output(self, output: Any) -> None:
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens > self._tokens:
            now = self._m.clock()
            if self._tokens == 0:
                self._m.ttft.observe(now - self._start)
            else:
                self._m.itl.observe(now - self._last)
            self._m.generation_tokens.inc(tokens - self._tokens)
            self._tokens, self._last = tokens, now
        if output.finished and not self._ended:
            self._ended = True
            self._m.e2e.observe(self._m.clock() - self._start)
            self._m.prompt_tokens.inc(len(output.prompt_token_ids))
            for choice in output.outputs:
                self._m.success.labels(choice.finish_reason or "unknown").inc()

    def fail(self, reason: str) -> None:
        """Counts the request as failed unless it already finished."""
        if not self._ended:
            self._ended = True
            self._m.failure.labels(reason).inc()


class _NodeCollector:
    """Reads Backend.metrics() at scrape time."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["node", "role"]
        families = {
            "num_running": GaugeMetricFamily("pdserve_num_requests_running", "Requests running.",
                                             labels=labels),
            "num_waiting": GaugeMetricFamily("pdserve_num_requests_waiting", "Requests waiting.",
                                             labels=labels),
            "kv_usage": GaugeMetricFamily("pdserve_kv_cache_usage", "Fraction of KV blocks in use.",
                                          labels=labels),
            "prefix_hit_rate": GaugeMetricFamily("pdserve_prefix_cache_hit_rate",
                                                 "Prompt tokens served from the prefix cache.",
                                                 labels=labels),
            "num_preemptions": CounterMetricFamily("pdserve_num_preemptions", "Preemptions.",
                                                   labels=labels),
        }
        kv = [CounterMetricFamily(f"pdserve_{name}", help_text, labels=labels)
              for name, help_text in zip(KV_COUNTERS, _KV_HELP)]
        for node in self._backend.metrics():
            for field, family in families.items():
                family.add_metric([node.node_id, node.role], getattr(node, field))
            for family, value in zip(kv, node.kv):        # disaggregated nodes only
                family.add_metric([node.node_id, node.role], value)
        yield from families.values()
        yield from kv


_KV_HELP = ("KV blocks a prefill node sent.", "KV bytes a prefill node sent.", "KV blocks a decode node received.",
            "KV bytes a decode node received.", "KV transfers committed.", "KV transfers failed.",
            "Malformed or hostile KV frames a decode node dropped.")
