"""`pdserve up` on the built-in model: it serves completions over HTTP (the `openai` client
included), starts a killed node again, and stops its nodes on SIGTERM. One `pdserve up` serves the
tests below, in order (starting one takes a router and two node processes); the last one stops it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.builtin import BUILTIN_MODEL_PATH
from tests.node_harness import process_alive
from tests.router.test_router_disagg_e2e import _children, _wait_healthy

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(BUILTIN_MODEL_PATH, "config.json")),
                                reason="the built-in model is not built")


@dataclass
class Up:
    """A running `pdserve up` and every node process the tests saw it run."""
    port: int
    process: subprocess.Popen
    log_path: Path
    nodes: set[int] = field(default_factory=set)

    def children(self) -> set[int]:
        pids = set(_children(self.process.pid))
        self.nodes |= pids
        return pids

    def complete(self, max_tokens: int) -> dict:
        body = json.dumps({"prompt": "ROMEO:", "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=60))


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`pdserve up` (a node restarts after 0.5 s), healthy; killed at the end if a test left it running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("pdserve_up") / "pdserve.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "router.launcher", "up", "--port", str(port),
                                 "--kv-cache-gib", "0.05", "--restart-backoff-s", "0.5"],
                                stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, proc)
        yield Up(port, proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_pdserve_up_serves_completions_and_the_openai_client(up):
    """`pdserve up` runs two node processes and serves completions over HTTP; the official
    `openai` client, unchanged, drives it."""
    assert len(up.children()) == 2
    answer = up.complete(8)
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
    _the_openai_client_drives_it(up.port, answer["choices"][0]["text"])


def _the_openai_client_drives_it(port: int, greedy_text: str) -> None:
    """The official `openai` client, unchanged, against `pdserve up`: models, a completion (the
    same greedy text as the plain HTTP request), a streamed chat, and an error as its exception."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    assert model == "shakespeare-6m"
    done = client.completions.create(model=model, prompt="ROMEO:", max_tokens=8, temperature=0)
    assert (done.choices[0].text, done.usage.completion_tokens) == (greedy_text, 8)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Speak, friend."}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as err:
        assert err.status_code == 404 and "no-such-model" in str(err)


def test_pdserve_up_starts_a_killed_node_again_and_serves_on(up):
    """kill -9 of `pdserve up`'s decode node: the launcher tells the router at once (/health 503
    while the pool is empty), starts the node again, it rejoins with a new epoch, and the next
    request completes."""
    before = up.children()
    decode = max(before, key=lambda pid: _cmdline(pid).count("decode_node"))
    os.kill(decode, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not up.children() - before:
        assert time.monotonic() < deadline, "the node was not started again"
        time.sleep(0.1)
    _wait_healthy(up.port, up.process)
    after = up.children()
    assert decode not in after and len(after) == 2 and len(after - before) == 1
    assert up.complete(4)["usage"]["completion_tokens"] == 4
    log = up.log_path.read_text(errors="replace")      # both lines are flushed before the node starts again
    assert "decode-0 exited with status -9" in log and "starting decode-0 again (restart 1 of 3)" in log


def test_pdserve_up_stops_its_nodes_on_sigterm(up):
    """SIGTERM ends `pdserve up` with status 0 and no node process it ran left; its log told how to
    reach it."""
    up.children()
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(30) == 0
    for pid in up.nodes:
        assert not process_alive(pid), f"node process {pid} outlived the launcher"
    log = up.log_path.read_text(errors="replace")
    assert "pdserve is up at" in log and "curl" in log


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")
