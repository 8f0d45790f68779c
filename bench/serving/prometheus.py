"""Scraping a server's Prometheus `/metrics` during a run: per-node KV usage over time, and the
change in counters (KV transfer bytes and seconds, prefix-cache hits, preemptions) over the run.

Series are picked by name fragments, so pdserve's (`pdserve_kv_cache_usage{node,role}`, transfer
counters) and vLLM's (`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_hits_total`) both show.
"""
from __future__ import annotations

import asyncio
import re
import time

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
GAUGE_FRAGMENTS = ("kv_cache_usage", "cache_usage_perc", "num_requests_running", "num_requests_waiting",
                   "hit_rate")
COUNTER_FRAGMENTS = ("bytes", "blocks", "prefix_cache", "preemption", "prompt_tokens", "generation_tokens",
                     "prefills")


def parse(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (histogram buckets and *_created dropped)."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1).endswith(("_bucket", "_created")):
            continue
        try:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        except ValueError:
            continue
    return out


def _picked(key: str, fragments: tuple[str, ...]) -> bool:
    name = key.split("{", 1)[0]
    return any(f in name for f in fragments)


def _counter(key: str) -> bool:
    """KV transfer series (any, histogram sums and counts included), else totals of interest."""
    name = key.split("{", 1)[0]
    if "transfer" in name:
        return True
    return name.endswith("_total") and not name.startswith("http_") and _picked(key, COUNTER_FRAGMENTS)


class Scraper:
    """Polls `/metrics` every `interval_s` until stopped; summary() condenses what it saw."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 1.0):
        self.client, self.url, self.interval = client, f"{base_url}/metrics", interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._task: asyncio.Task | None = None

    async def scrape_once(self) -> None:
        try:
            resp = await self.client.get(self.url, timeout=5.0)
        except httpx.HTTPError:
            return
        if resp.status_code == 200:
            self.samples.append((time.perf_counter(), parse(resp.text)))

    async def _loop(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.scrape_once()

    def summary(self) -> dict:
        """{"available", "gauges": {series: {mean, max}}, "counter_deltas": {series: last - first}}."""
        if not self.samples:
            return {"available": False}
        gauges: dict[str, list[float]] = {}
        for _, sample in self.samples:
            for key, value in sample.items():
                if _picked(key, GAUGE_FRAGMENTS):
                    gauges.setdefault(key, []).append(value)
        first, last = self.samples[0][1], self.samples[-1][1]
        deltas = {k: v - first.get(k, 0.0) for k, v in last.items() if _counter(k)}
        return {"available": True, "num_scrapes": len(self.samples),
                "gauges": {k: {"mean": sum(v) / len(v), "max": max(v)} for k, v in gauges.items()},
                "counter_deltas": {k: v for k, v in deltas.items() if v}}
