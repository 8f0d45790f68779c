"""The Ray actor that runs one pdserve node process on the host Ray placed it on.

    __init__ ──▶ starts `python -m <role>_node --router R --node-id ID [node flags]` bound to this
                 host's address (decode: --kv-bind tcp://IP:0 --kv-advertise-host IP; --p2p-host IP),
                 the cluster secret in its environment, never its argv; the actor reads the secret
                 from Ray's object store (NodeLaunch.secret), so it is not in the actor's arguments,
                 which Ray keeps in its control store for restarts
    the node exits 0 (drained, removed: it said goodbye) ──▶ wait_exit() returns; the fleet kills
                 this actor for good
    the node dies (any other status) ──▶ this actor's process exits too, so Ray restarts the actor
                 (at most max_restarts times): __init__ again, a new node process with a new epoch
                 that rejoins the router
    this actor's process dies, or its host ──▶ the node gets SIGTERM (parent-death signal) and
                 says goodbye; Ray restarts the actor on a host with room

Runs inside a Ray worker; imports nothing of pdserve's engine (the node process does).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any, NamedTuple

from router.node_processes import signal_group, with_parent_death_signal

_DIED_STATUS = 3        # this actor's exit status when its node died: Ray sees an actor failure
SECRET_TIMEOUT_S = 60.0  # longest wait for the cluster secret from the object store; then __init__ fails (Ray retries)


class NodeLaunch(NamedTuple):
    """What a node actor starts; the same on every restart."""
    role: str                   # "prefill" | "decode"
    node_id: str
    router: str                 # the router's control endpoint
    node_flags: tuple[str, ...]  # --model DIR and the engine and node flags
    secret: Any                 # ray.ObjectRef of the cluster secret (hex), put by the fleet; handed to the node in its environment
    threads: int                # OMP_NUM_THREADS of the node process


class Incarnation(NamedTuple):
    """One start of a node actor."""
    host: str                   # the address Ray gave this host; the node advertises it
    pid: int                    # the node process
    actor_pid: int              # this actor's process


class NodeActor:
    def __init__(self, launch: NodeLaunch):
        import ray
        from ray.util import get_node_ip_address

        self._host, self._node_id = get_node_ip_address(), launch.node_id
        self._stopping = False
        self._left = threading.Event()
        self._process = subprocess.Popen(with_parent_death_signal(node_argv(launch, self._host)),
                                         start_new_session=True, env=_node_env(launch, ray.get(launch.secret, timeout=SECRET_TIMEOUT_S)))
        threading.Thread(target=self._watch, name="node-watch", daemon=True).start()

    def info(self) -> Incarnation:
        return Incarnation(self._host, self._process.pid, os.getpid())

    def wait_exit(self) -> int:
        """Returns once the node process exited 0 (it left on purpose); a node that dies takes
        this actor with it instead, so the caller sees the actor fail."""
        self._left.wait()
        return 0

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the node (it says goodbye), SIGKILL after grace_s; its exit status."""
        self._stopping = True
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            signal_group(self._process, sig)     # the node and its tensor-parallel workers
            try:
                return self._process.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _watch(self) -> None:
        status = self._process.wait()
        if status == 0 or self._stopping:
            self._left.set()
            return
        print(f"node actor: {self._node_id} exited with status {status}; ending this actor so Ray "
              "restarts it", file=sys.stderr, flush=True)
        os._exit(_DIED_STATUS)


def node_argv(launch: NodeLaunch, host: str) -> list[str]:
    """The node's command line, bound to and advertising `host`."""
    argv = [sys.executable, "-m", f"{launch.role}_node", "--router", launch.router, "--node-id", launch.node_id,
            *launch.node_flags, "--p2p-host", host]
    if launch.role == "decode":
        argv += ["--kv-bind", tcp_endpoint(host, 0), "--kv-advertise-host", host]
    return argv


def _node_env(launch: NodeLaunch, secret_hex: str) -> dict[str, str]:
    from kvtransport.secret import ENV_VAR
    from router.config import without_keys

    return dict(without_keys(os.environ), OMP_NUM_THREADS=str(launch.threads),
                OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), **{ENV_VAR: secret_hex})


def tcp_endpoint(host: str, port: int) -> str:
    """tcp://HOST:PORT, an IPv6 host in brackets (port 0: any free one, when binding)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
