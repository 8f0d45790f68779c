"""The node processes `pdserve up` starts on this machine: spawn, wait for, supervise, stop.

Each node runs as `python -m <role>_node --router ENDPOINT --node-id <role>-<i> [node flags]` in
its own session (Ctrl-C reaches only the launcher), with the cluster secret in its environment,
never its argv, and (Linux) SIGTERM if the launcher dies, however it dies. While the router
serves, supervise() reports a node that exits, tells the router at once, and starts it again
unless it exited cleanly (see its docstring).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from kvtransport.secret import ENV_VAR, encode_secret
from router.config import without_keys

_STOP_GRACE_S = 10.0
# Run as `python -c SHIM PARENT_PID ARGV...`: ask Linux for SIGTERM when the parent dies, then
# become ARGV. PR_SET_PDEATHSIG (1) survives exec; the ppid check closes the race with an early death.
_PARENT_DEATH_SHIM = ("import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 15); "
                      "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = 1                    # prefill node processes started here (others may join)
    decode: int = 1                     # decode node processes started here (others may join)
    prefill_tp: int = 1                 # tensor_parallel_size of each prefill node
    decode_tp: int = 1                  # tensor_parallel_size of each decode node
    startup_timeout_s: float = 600.0    # longest wait for every node to register
    max_restarts: int = 3               # a node that dies is started again at most this often
    restart_backoff_s: float = 1.0      # wait before a node's first restart, doubled for each next one
    max_pool_size: int = 16             # most nodes of one role a scale (pdserve scale, /admin/pools) may ask for

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError(f"need >= 0 prefill and decode nodes, got {self.prefill} and {self.decode}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"tp must be >= 1, got prefill_tp {self.prefill_tp} and decode_tp {self.decode_tp}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.max_pool_size < max(1, self.prefill, self.decode):
            raise ValueError(f"max_pool_size must be >= 1 and >= the nodes started, got {self.max_pool_size}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError("max_restarts and restart_backoff_s must be >= 0")


@dataclass(slots=True)
class NodeProcess:
    node_id: str
    role: str                           # "prefill" | "decode"
    process: subprocess.Popen
    argv: list[str] = field(default_factory=list)        # how to start it again
    env: dict[str, str] = field(default_factory=dict)
    reported: bool = False              # its exit has been reported
    restarts: int = 0
    restart_at: float | None = None     # when it starts again (loop time), once it died
    retired: bool = False               # stopped on purpose: never started again

    def start(self) -> None:
        self.process = subprocess.Popen(with_parent_death_signal(self.argv), start_new_session=True, env=self.env)

    def retire(self) -> None:
        """SIGTERM to the node and anything it started; the supervisor does not start it again."""
        self.retired = True
        signal_group(self.process, signal.SIGTERM)


class NodeSpawner:
    """Starts node processes on this machine, each with the next unused id of its role
    (prefill-0, prefill-1, ...; an id is never reused, so a node scaled away and a new one differ)."""

    def __init__(self, endpoint: str, cluster: ClusterConfig, node_flags: list[str], secret: bytes):
        self._endpoint, self._node_flags = endpoint, node_flags
        self._tps = {"prefill": cluster.prefill_tp, "decode": cluster.decode_tp}
        self._counts = {"prefill": 0, "decode": 0}
        # The first nodes' ranks share this machine's cores: an equal share per rank rather than
        # oversubscribing (unless OMP_NUM_THREADS is set); a tp node's ranks split the node's
        # threads. Nodes a scale-up adds later get the same share.
        ranks = cluster.prefill * cluster.prefill_tp + cluster.decode * cluster.decode_tp
        self._per_rank = max(1, (os.cpu_count() or 1) // max(1, ranks))
        self._base = dict(without_keys(os.environ), OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                          **{ENV_VAR: encode_secret(secret)})

    def spawn(self, role: str) -> NodeProcess:
        node_id = f"{role}-{self._counts[role]}"
        self._counts[role] += 1
        argv = [sys.executable, "-m", f"{role}_node", "--router", self._endpoint, "--node-id", node_id,
                *self._node_flags]
        tp = self._tps[role]
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        env = dict(self._base, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(self._per_rank * tp)))
        node = NodeProcess(node_id, role, None, argv, env)
        node.start()
        return node

    def spawn_pools(self, cluster: ClusterConfig) -> list[NodeProcess]:
        """The deployment's first nodes: cluster.prefill prefill nodes, then cluster.decode decode nodes."""
        return [self.spawn(role) for role in ["prefill"] * cluster.prefill + ["decode"] * cluster.decode]


class LocalFleet:
    """The NodeFleet of `pdserve up` (router/node_fleet.py): node processes on this machine."""

    def __init__(self, cluster: ClusterConfig, node_flags: list[str]):
        self._cluster, self._node_flags = cluster, node_flags
        self.nodes: list[NodeProcess] = []
        self._spawner: NodeSpawner | None = None
        self._registry: Any = None

    def start(self, endpoint: str, backend: Any, secret: bytes) -> None:
        from router.fleet_scaler import FleetScaler

        self._spawner = NodeSpawner(endpoint, self._cluster, self._node_flags, secret)
        self._registry = backend.server.registry
        self.nodes.extend(self._spawner.spawn_pools(self._cluster))
        if self.nodes:       # a router alone (`pdserve router`) starts no nodes: they are started by hand
            backend.operator.scaler = FleetScaler(self, self._registry, backend.operator, self._cluster)

    def add(self, role: str) -> NodeProcess:
        """A new node process, supervised (and restarted) like the first ones."""
        node = self._spawner.spawn(role)
        self.nodes.append(node)
        return node

    def starting(self, role: str) -> list[NodeProcess]:
        """Running, not registered (yet, or again after a restart), oldest first."""
        return [n for n in self.nodes if n.role == role and n.process.poll() is None
                and self._registry.get(n.node_id) is None]

    def retire(self, node: NodeProcess) -> None:
        node.retire()

    def starts_nodes(self) -> bool:
        return bool(self.nodes)

    async def wait_registered(self, backend: Any) -> bool:
        return await wait_registered(backend, self.nodes, self._cluster.startup_timeout_s)

    async def supervise(self, backend: Any) -> None:
        await supervise(self.nodes, backend, self._cluster)

    def stop(self) -> None:
        stop_nodes(self.nodes)


def stop_nodes(nodes: list[NodeProcess], grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM to every node's process group, SIGKILL to those still there after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for node in nodes:
            if node.process.poll() is None:
                signal_group(node.process, sig)
        for node in nodes:
            try:
                node.process.wait(grace_s if sig == signal.SIGTERM else None)
            except subprocess.TimeoutExpired:
                pass


async def wait_registered(backend: Any, nodes: list[NodeProcess], timeout_s: float) -> bool:
    """Until every node has said hello; False (after saying why) if one exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline, shown = loop.time() + timeout_s, None
    while True:
        registered = [n for n in nodes if backend.server.info(n.node_id) is not None]
        progress = {r: sum(n.role == r for n in registered) for r in ("prefill", "decode")}
        if progress != shown:
            shown = progress
            total = {r: sum(n.role == r for n in nodes) for r in ("prefill", "decode")}
            print(f"pdserve: nodes registered: prefill {progress['prefill']}/{total['prefill']}, "
                  f"decode {progress['decode']}/{total['decode']}", flush=True)
        if len(registered) == len(nodes):
            return True
        for node in nodes:
            if node.process.poll() is not None:
                print(f"pdserve: {node.node_id} exited with status {node.process.returncode} before "
                      "registering (its log is above)", file=sys.stderr, flush=True)
                return False
        if loop.time() > deadline:
            print(f"pdserve: nodes did not register within {timeout_s} s", file=sys.stderr, flush=True)
            return False
        await asyncio.sleep(0.1)


async def supervise(nodes: list[NodeProcess], backend: Any, cluster: ClusterConfig) -> None:
    """Supervises the nodes started here while the router serves: a node process that exits is
    reported, and the router told at once (its requests move now, even without a goodbye); unless
    it exited cleanly (status 0: drained, removed or stopped on purpose) it is started again after
    a backoff (restart_backoff_s, doubled each time), at most max_restarts times, and rejoins with
    a new epoch."""
    loop = asyncio.get_running_loop()
    while True:
        for node in nodes:
            if not node.reported and node.process.poll() is not None:
                node.reported = True
                print(f"pdserve: {node.node_id} exited with status {node.process.returncode}",
                      file=sys.stderr, flush=True)
                backend.server.node_exited(node.node_id, f"status {node.process.returncode}")
                if node.process.returncode != 0 and not node.retired and node.restarts < cluster.max_restarts:
                    node.restart_at = loop.time() + cluster.restart_backoff_s * 2 ** node.restarts
            if node.restart_at is not None and loop.time() >= node.restart_at:
                node.restarts, node.restart_at, node.reported = node.restarts + 1, None, False
                print(f"pdserve: starting {node.node_id} again (restart {node.restarts} of "
                      f"{cluster.max_restarts})", file=sys.stderr, flush=True)
                node.start()
                backend.note_restart(node.node_id)
        await asyncio.sleep(0.2)


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """argv run so that (Linux) the process gets SIGTERM when this one dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _PARENT_DEATH_SHIM, str(os.getpid()), *argv]


def signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)     # the node and anything it started
    except (ProcessLookupError, PermissionError):
        pass
