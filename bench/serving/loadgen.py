"""The load generator: send a workload at an offered rate (gamma/Poisson arrivals), optionally
capped at a fixed concurrency, stream every answer, and return the timed records.

Bounded: every request is sent at most once, and the whole run ends at `deadline_s`; requests
still open then are cancelled (the client disconnects, servers abort them) and recorded as
failed with error "deadline".

    arrival schedule (arrivals.py) ──▶ task per request ──[semaphore if max_concurrency]──▶ send()
                                                          records ◀── client.py
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bench.serving.arrivals import achieved_rate, arrival_times
from bench.serving.client import Endpoint, send
from bench.serving.metrics import RequestRecord
from bench.serving.prometheus import Scraper
from bench.serving.workloads import BenchRequest


@dataclass(frozen=True, slots=True)
class LoadSpec:
    rate: float                     # offered requests/s; inf sends all at t = 0
    burstiness: float = 1.0         # gamma shape; 1 = Poisson
    max_concurrency: int | None = None
    seed: int = 0
    deadline_s: float = 600.0       # the run ends here whatever is still open


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float               # first send to last completion (or the deadline)
    achieved_rate: float            # requests/s actually sent
    scheduled_rate: float           # requests/s of the drawn schedule (a finite sample of the process)
    max_send_lag_s: float           # worst delay of a send behind its scheduled time
    prometheus: dict                # Scraper.summary()


def prompt_text(request: BenchRequest, vocab: list[str]) -> str:
    """The prompt as words; the benchmark tokenizer maps it back to exactly `prompt_ids`."""
    return " ".join(vocab[t] for t in request.prompt_ids)


async def run_load(endpoint: Endpoint, requests: list[BenchRequest], vocab: list[str], load: LoadSpec,
                   desc: str = "") -> RunResult:
    texts = [prompt_text(r, vocab) for r in requests]
    records = [RequestRecord(r.prompt_len, r.output_len, r.kind) for r in requests]
    schedule = arrival_times(len(requests), load.rate, load.burstiness, load.seed)
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        scraper = Scraper(client, endpoint.base_url)
        await scraper.scrape_once()
        scraper.start()
        bar = tqdm(total=len(requests), desc=desc or f"rate {load.rate}", leave=False, mininterval=1.0)
        with collector_off():
            start = time.perf_counter()
            tasks = await _dispatch(client, endpoint, texts, records, schedule, gate, start, load.deadline_s, bar)
            done, pending = await asyncio.wait(tasks, timeout=max(0.0, start + load.deadline_s - time.perf_counter()))
            duration = time.perf_counter() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
        await scraper.stop()
    for r in records:
        if not r.success and not r.error:
            r.error = "deadline"
    sent = [r.send_time for r in records if r.send_time >= 0]
    lag = max((r.send_time - at for r, at in zip(records, schedule) if r.send_time >= 0), default=0.0)
    return RunResult(records, duration, achieved_rate(sent), achieved_rate(list(schedule[:len(sent)])), lag,
                     scraper.summary())


@contextlib.contextmanager
def collector_off():
    """The cyclic garbage collector off while requests are sent and streamed, after one full
    collection. A collection stops the event loop: sends go late and the open streams' tokens wait
    in the socket, then arrive together. Allocation counts trigger it, so it falls at the same
    request of the same run (against a local stub, a 28-37 ms full collection 27.3 s into the first
    ShareGPT-like point: send lag 29-38 ms; in quiet8's traced real runs, full collections of 34-72
    ms; bench/README.md, sim20). Cycles made meanwhile are collected when it is back on."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def _dispatch(client, endpoint, texts, records, schedule, gate, start, deadline_s, bar) -> list[asyncio.Task]:
    """Start one task per request at its arrival time (until the deadline)."""
    tasks = []
    for text, record, at in zip(texts, records, schedule):
        record.send_time = -1.0         # not sent (yet)
        delay = start + at - time.perf_counter()
        if at >= deadline_s:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(client, endpoint, text, record, gate, start, bar)))
    return tasks


async def _one(client, endpoint, text, record, gate, start, bar) -> None:
    if gate is None:
        record.send_time = time.perf_counter() - start
        await send(client, endpoint, text, record)
    else:
        async with gate:
            record.send_time = time.perf_counter() - start
            await send(client, endpoint, text, record)
    bar.update(1)


def finite(x: float) -> float | str:
    """JSON-safe rate: inf as the string "inf"."""
    return "inf" if math.isinf(x) else x
