"""The per-node series of /metrics, read from Backend.metrics() at scrape time, labelled by node and
role: load gauges, prefix-cache and KV-transfer counters, and the cache layout as an info series."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdwire.figures import KV_COUNTERS
from router.backend import Backend, NodeMetrics

_LABELS = ["node", "role"]
_GAUGES = {     # NodeMetrics field -> (series, help)
    "num_running": ("pdserve_num_requests_running", "Requests running."),
    "num_waiting": ("pdserve_num_requests_waiting", "Requests waiting."),
    "kv_usage": ("pdserve_kv_cache_usage", "Fraction of KV blocks in use."),
    "prefix_hit_rate": ("pdserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, "
                        "since the node started (rate() the counters for a window)."),
}
_KV_HELP = ("KV blocks a prefill node sent.", "KV bytes a prefill node sent.", "KV blocks a decode node received.",
            "KV bytes a decode node received.", "KV transfers committed.", "KV transfers failed.",
            "Malformed or hostile KV frames a decode node dropped.")


class NodeCollector:
    """Reads Backend.metrics() at scrape time."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        nodes = self._backend.metrics()
        for field, (name, help_text) in _GAUGES.items():
            yield _family(GaugeMetricFamily(name, help_text, labels=_LABELS), nodes, lambda n, f=field: getattr(n, f))
        yield _family(CounterMetricFamily("pdserve_num_preemptions", "Preemptions.", labels=_LABELS),
                      nodes, lambda n: n.num_preemptions)
        yield _family(CounterMetricFamily("pdserve_prefix_cache_queries", "Prompt tokens looked up in the "
                                          "prefix cache.", labels=_LABELS), nodes, lambda n: n.prefix.queried_tokens)
        yield _family(CounterMetricFamily("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix "
                                          "cache.", labels=_LABELS), nodes, lambda n: n.prefix.hit_tokens)
        for i, (name, help_text) in enumerate(zip(KV_COUNTERS, _KV_HELP)):     # disaggregated nodes only
            yield _family(CounterMetricFamily(f"pdserve_{name}", help_text, labels=_LABELS),
                          [n for n in nodes if n.kv], lambda n, i=i: n.kv[i])
        yield _cache_config(nodes)


def _family(family: Metric, nodes: list[NodeMetrics], value) -> Metric:
    for node in nodes:
        family.add_metric([node.node_id, node.role], value(node))
    return family


def _cache_config(nodes: list[NodeMetrics]) -> Metric:
    """vLLM's cache_config_info: always 1, the layout in its labels."""
    family = GaugeMetricFamily("pdserve_cache_config_info", "KV cache layout of each node (value 1).",
                               labels=[*_LABELS, "block_size", "num_blocks"])
    for node in nodes:
        family.add_metric([node.node_id, node.role, str(node.block_size), str(node.num_blocks)], 1)
    return family
