"""A multi-host Ray cluster on one machine, and `pdserve ray up` on it, for tests/ray.

Three Ray nodes, each its own host address on loopback (ray.cluster_utils.Cluster):

    127.0.0.2  head: the driver (`pdserve ray up`, the router) and room for 2 prefill nodes
    127.0.0.3  room for 2 decode nodes
    127.0.0.4  room for 2 decode nodes

Ray's CPUs are logical here: the machine's two cores are shared by every process.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

REPO = str(Path(__file__).resolve().parents[2])
HOSTS = {"head": "127.0.0.2", "decode-a": "127.0.0.3", "decode-b": "127.0.0.4"}
ADMIN_KEY = "ray-test-admin-key"
NODE_FLAGS = ["--dtype", "float32", "--num-blocks", "64", "--max-num-seqs", "8", "--block-size", "16"]
# A lost host is noticed in ~3 s rather than Ray's default ~30 s, so its actors move soon.
_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
# Only bounds a hang: three raylets starting on a starved 2-core machine may take minutes.
START_S = 300.0


@contextlib.contextmanager
def _patient_registration(wait_s: float) -> Iterator[None]:
    """Ray gives a new raylet 30 s (hard-coded) to register with the GCS; each lookup it makes
    meanwhile waits here up to wait_s for the registration instead."""
    from ray._private import services

    get_node = services.get_node

    def patient(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:        # not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    services.get_node = patient
    try:
        yield
    finally:
        services.get_node = get_node


def start_cluster() -> Any:
    """The three-host cluster; its workers import this checkout."""
    from ray.cluster_utils import Cluster

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, saved) if p)     # the raylets pass it on
    cluster = None
    try:
        with _patient_registration(START_S):
            cluster = Cluster(initialize_head=True, head_node_args=dict(
                num_cpus=2, resources={"prefill": 2}, node_ip_address=HOSTS["head"], _system_config=_HEALTH_CHECK))
            for name in ("decode-a", "decode-b"):
                cluster.add_node(num_cpus=2, resources={"decode": 2}, node_ip_address=HOSTS[name])
        cluster.wait_for_nodes(START_S)
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return cluster


class Deployment:
    """`pdserve ray up` as a process: its HTTP port, log and operator API."""

    def __init__(self, address: str, model: str, log_path: Path, prefill: int, decode: int, flags: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "router.launcher", "ray", "up", "--address", address, "--name", "t",
                "--prefill", str(prefill), "--decode", str(decode), "--model", model, "--port", str(self.port),
                "--admin-api-key", ADMIN_KEY, "--max-pool-size", "3", *NODE_FLAGS, *flags]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self.admin = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"})

    def nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in self.admin.get("/admin/nodes").json()["data"]}

    def pools(self) -> dict[str, dict]:
        return {p["role"]: p for p in self.admin.get("/admin/pools").json()["data"]}

    def scale(self, role: str, count: int) -> dict:
        reply = self.admin.post(f"/admin/pools/{role}", json={"count": count, "drain_deadline_s": 5.0})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def complete(self, prompt: str, max_tokens: int, on_text: Callable[[str], None] | None = None) -> str:
        """A streamed greedy completion's text."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        text = ""
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=180) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
                    if on_text is not None:
                        on_text(text)
        return text

    def until(self, ok: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            assert self.process.poll() is None, f"pdserve ray up exited:\n{self.log_tail()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.log_tail()}"
            time.sleep(0.2)

    def serving(self, nodes: int) -> bool:
        try:
            return len([n for n in self.nodes().values() if n["state"] == "active"]) == nodes
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def stop(self) -> int | None:
        self.admin.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
