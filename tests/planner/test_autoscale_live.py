"""A real `pdserve up --autoscale` on the built-in model under a load ramp (low -> high -> idle):
the pools grow while the load is high and shrink back once it is gone, and no request fails."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.http_server import free_port
from tests.router_process import ROOT

ADMIN = "autoscale-admin-key"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 2
MAX_TOKENS = 96
NODE_FLAGS = ["--dtype", "float32", "--num-blocks", "40", "--max-num-seqs", "8"]     # ~3 requests per decode node
AUTOSCALE = ["--autoscale", "--autoscale-max-prefill", "2", "--autoscale-max-decode", "2",
             "--autoscale-slo-ttft-ms", "250", "--autoscale-slo-itl-ms", "2000", "--autoscale-interval-s", "1",
             "--autoscale-window-s", "4", "--autoscale-down-after-s", "1", "--autoscale-cooldown-s", "2",
             "--autoscale-drain-deadline-s", "10"]


def test_a_load_ramp_grows_then_shrinks_the_pools_with_no_failed_request(tmp_path):
    """Low load: pools stay at 1. High load (decode KV full, admissions wait, TTFT up): the decode
    and prefill pools grow to 2. Idle: both drain back to 1. Every request completes in full, and
    /metrics counts the decisions."""
    port = free_port()
    log = open(tmp_path / "pdserve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.launcher", "up", "--port", str(port), "--max-pool-size", "2",
         "--admin-api-key", ADMIN, "--heartbeat-timeout-s", "30", *NODE_FLAGS, *AUTOSCALE],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        asyncio.run(asyncio.wait_for(_ramp(f"http://127.0.0.1:{port}"), 150))
        decisions = [line for line in (tmp_path / "pdserve.log").read_text().splitlines() if "autoscaler:" in line]
        assert any("-> 2" in line for line in decisions) and any("-> 1" in line for line in decisions), decisions
    finally:
        log.close()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def _ramp(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await _until(lambda: _healthy(http), 90)
        seen = []
        for _ in range(3):                                      # low: one request at a time
            await _complete(http)
        seen.append(await _targets(http))
        assert seen[-1] == {"prefill": 1, "decode": 1}
        stop = asyncio.Event()
        high = asyncio.create_task(_load(http, stop, concurrency=24))   # high: until both pools grew
        grown = await _until(lambda: _grown(http), 60)
        await asyncio.sleep(3)                                  # the new nodes take work too
        stop.set()
        await high
        shrunk = await _until(lambda: _shrunk(http), 60)       # idle: back to the minimum
        assert grown and shrunk
        metrics = (await http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).text  # a key is set
        assert 'pdserve_autoscaler_decisions_total{direction="up"' in metrics
        assert 'pdserve_autoscaler_decisions_total{direction="down"' in metrics


async def _load(http: httpx.AsyncClient, stop: asyncio.Event, concurrency: int) -> None:
    """`concurrency` clients, each sending one request after another until `stop` (bounded: 60 s)."""
    deadline = time.monotonic() + 60

    async def client() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            await _complete(http)
    await asyncio.gather(*(client() for _ in range(concurrency)))


async def _complete(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"model": "shakespeare-6m", "prompt": PROMPT,
                                                 "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS


async def _targets(http: httpx.AsyncClient) -> dict[str, int]:
    return {role: p["target"] for role, p in (await _pools(http)).items()}


async def _pools(http: httpx.AsyncClient) -> dict[str, dict]:
    r = await http.get("/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"})
    return {p["role"]: p for p in r.json()["data"]}


async def _grown(http: httpx.AsyncClient) -> bool:
    pools = await _pools(http)
    return all(p["target"] == 2 for p in pools.values())


async def _shrunk(http: httpx.AsyncClient) -> bool:
    pools = await _pools(http)
    return all(p["target"] == 1 and p["active"] == 1 and p["draining"] == 0 for p in pools.values())


async def _healthy(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def _until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.5)
    raise AssertionError(f"not reached within {timeout_s} s")
