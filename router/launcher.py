"""`pdserve`: start a disaggregated deployment on this machine, or the colocated server.

    pdserve up [--model DIR] [--prefill N] [--decode M] [--prefill-tp A] [--decode-tp B]
               [--host H] [--port P] [node flags]
    pdserve router [--model DIR] [router flags]     the router alone: nodes join from anywhere
    pdserve prefill|decode --router ENDPOINT --node-id ID [node flags]   one node
    pdserve colocated [flags of `python -m router`]
    pdserve secret             prints a fresh cluster secret (64 hex digits)
    pdserve nodes | drain NODE | remove NODE      the operator API (router/operator_cli.py)

A multi-host deployment: `pdserve secret > secret && chmod 600 secret`, copy the file to every
host, then `pdserve router --cluster-secret-file secret --host 0.0.0.0 --control-endpoint
tcp://0.0.0.0:7100` on host A, and on hosts B, C: `pdserve prefill|decode --router tcp://A:7100
--node-id ... --cluster-secret-file secret` (decode nodes: `--kv-bind tcp://0.0.0.0:7200
--kv-advertise-host B`).

`pdserve up`:
  0. it takes the cluster secret from --cluster-secret-file or $PDSERVE_CLUSTER_SECRET, else makes
     a fresh one; every node gets it in its environment (never its argv) and must prove it
     holds it before the router or a decode node reads a byte it sends (kvtransport.session)
  1. this process binds the router's control socket and spawns N prefill and M decode node
     processes (`python -m prefill_node|decode_node --router ENDPOINT --node-id ...`); each is
     in its own session, so Ctrl-C reaches only this process, and (Linux) gets SIGTERM if this
     process dies, however it dies
  2. it waits until every node has registered (a node that exits first is an error)
  3. it serves the OpenAI API (FastAPI under uvicorn, on a uvloop event loop) and prints the URL
  4. on Ctrl-C or SIGTERM it stops serving and terminates the nodes (SIGKILL after a grace period)

Flags come from the config dataclasses: RouterConfig's (--port, --api-key, ...), ClusterConfig's
(--prefill, --decode, --prefill-tp, --decode-tp, --startup-timeout-s) and the node's own
(node_shell.config.NodeConfig: --dtype, --block-size, --kv-cache-gib, --max-num-seqs, ...),
passed to every node only if given. --prefill-tp / --decode-tp set each kind's
--tensor-parallel-size (each node then runs that many processes); any two values pair, since
blocks travel between nodes with every kv head.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from kvtransport.secret import ENV_VAR, SecretError, encode_secret, load_secret, new_secret
from engine.flags import add_dataclass_args, build_dataclass
from router.config import RouterConfig

# NodeConfig fields the launcher sets itself, per node, instead of taking them as flags
_PER_NODE_FIELDS = ("router", "node_id", "kv_bind", "tensor_parallel_size", "cluster_secret_file")
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

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError(f"need >= 0 prefill and decode nodes, got {self.prefill} and {self.decode}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"tp must be >= 1, got prefill_tp {self.prefill_tp} and decode_tp {self.decode_tp}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
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

    def start(self) -> None:
        self.process = subprocess.Popen(_with_parent_death_signal(self.argv), start_new_session=True, env=self.env)


class UpArgs(NamedTuple):
    router: RouterConfig
    cluster: ClusterConfig
    model: str | None           # --model as given; None: the built-in model
    node_flags: list[str]       # the node flags given, as node argv, --model aside


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["colocated"]:
        from router.cli import main as colocated
        return colocated(argv[1:])
    if argv[:1] == ["secret"]:
        return print(encode_secret(new_secret()))
    if argv[:1] in (["prefill"], ["decode"]):
        return _node_main(argv[0], argv[1:])
    if argv[:1] in (["nodes"], ["drain"], ["remove"]):
        from router import operator_cli
        sys.exit(operator_cli.main(argv))
    if argv[:1] == ["router"]:
        argv = ["up", *argv[1:], "--prefill", "0", "--decode", "0"]
    args = parse_up(argv)
    model = _model_path(args.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    sys.exit(up(model, args.router, args.cluster, ["--model", model, *args.node_flags]))


def parse_up(argv: Sequence[str]) -> UpArgs:
    """`up` and its flags; exits with a usage error for bad ones."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    try:
        router = build_dataclass(RouterConfig, args)
        cluster = build_dataclass(ClusterConfig, args)
    except ValueError as err:
        parser.error(str(err))
    return UpArgs(router, cluster, args.get("node_model"), _node_flags(args))


def up(model: str, router: RouterConfig, cluster: ClusterConfig, node_flags: list[str]) -> int:
    """Runs the deployment until Ctrl-C or SIGTERM; returns the exit status."""
    import uvloop

    nodes: list[NodeProcess] = []
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return uvloop.run(_serve(model, router, cluster, node_flags, nodes))
    except KeyboardInterrupt:
        print("\npdserve: shutting down", flush=True)
        return 0
    finally:
        stop_nodes(nodes)
        signal.signal(signal.SIGTERM, previous)


async def _serve(model: str, config: RouterConfig, cluster: ClusterConfig, node_flags: list[str],
                 nodes: list[NodeProcess]) -> int:
    from router.http.app import create_app
    from router.cluster.disaggregated import DisaggregatedBackend
    from router.http.server import PortInUse, Server, bind_http

    try:
        sock = bind_http(config)
    except PortInUse as err:
        print(err, file=sys.stderr, flush=True)
        return 1
    secret = _cluster_secret(config, cluster)
    backend = DisaggregatedBackend.from_model(model, secret, config)
    try:
        endpoint = await backend.start()
        print(f"pdserve: router control plane at {endpoint}; starting {cluster.prefill} prefill "
              f"(tp {cluster.prefill_tp}) and {cluster.decode} decode (tp {cluster.decode_tp}) node(s) "
              f"of {model}; more join with `pdserve prefill|decode --router {endpoint} --node-id ID` "
              f"and the cluster secret", flush=True)
        nodes.extend(spawn_nodes(endpoint, cluster, node_flags, secret))
        if not await _wait_registered(backend, nodes, cluster.startup_timeout_s):
            return 1
        server = Server(create_app(backend, config), config, log_level="info")   # bounded shutdown: router/http/server.py
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        watching = asyncio.create_task(_watch(nodes, backend, cluster))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        greeting = None
        if server.started:
            _print_ready(config, backend.model_name)
            if nodes:          # a router alone waits for nodes from elsewhere: nothing to greet yet
                greeting = asyncio.create_task(_first_request(config, backend.model_name))
        await serving
        watching.cancel()
        if greeting is not None:
            greeting.cancel()
        return 0 if server.started else 1
    finally:
        backend.close()
        sock.close()


def _cluster_secret(config: RouterConfig, cluster: ClusterConfig) -> bytes:
    """The secret given (file or environment), else a fresh one for a deployment whose nodes
    all start here; a router that others' nodes join must be given one."""
    if config.cluster_secret_file or os.environ.get(ENV_VAR) or cluster.prefill == 0 or cluster.decode == 0:
        try:
            return load_secret(config.cluster_secret_file)
        except SecretError as err:
            sys.exit(f"pdserve: {err}")
    return new_secret()


def _node_main(role: str, argv: list[str]) -> None:
    """`pdserve prefill|decode ...`: one node of that role, as `python -m <role>_node`."""
    from node_shell.runtime import main as node_main

    if role == "prefill":
        from prefill_node.service import PrefillService as service
    else:
        from decode_node.service import DecodeService as service
    node_main(role, service, argv)


def spawn_nodes(endpoint: str, cluster: ClusterConfig, node_flags: list[str], secret: bytes) -> list[NodeProcess]:
    roles = ["prefill"] * cluster.prefill + ["decode"] * cluster.decode
    tps = {"prefill": cluster.prefill_tp, "decode": cluster.decode_tp}
    counts = {"prefill": 0, "decode": 0}
    nodes = []
    # The nodes' ranks share this machine's cores: an equal share per rank rather than
    # oversubscribing (unless OMP_NUM_THREADS is set); a tp node's ranks split the node's threads.
    per_rank = max(1, (os.cpu_count() or 1) // max(1, sum(tps[role] for role in roles)))
    base = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                **{ENV_VAR: encode_secret(secret)})
    for role in roles:
        node_id = f"{role}-{counts[role]}"
        counts[role] += 1
        argv = [sys.executable, "-m", f"{role}_node", "--router", endpoint, "--node-id", node_id, *node_flags]
        tp = tps[role]
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        env = dict(base, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(per_rank * tp)))
        node = NodeProcess(node_id, role, None, argv, env)
        node.start()
        nodes.append(node)
    return nodes


def stop_nodes(nodes: list[NodeProcess], grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM to every node's process group, SIGKILL to those still there after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for node in nodes:
            if node.process.poll() is None:
                _signal_group(node.process, sig)
        for node in nodes:
            try:
                node.process.wait(grace_s if sig == signal.SIGTERM else None)
            except subprocess.TimeoutExpired:
                pass


async def _wait_registered(backend: Any, nodes: list[NodeProcess], timeout_s: float) -> bool:
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


async def _watch(nodes: list[NodeProcess], backend: Any, cluster: ClusterConfig) -> None:
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
                if node.process.returncode != 0 and node.restarts < cluster.max_restarts:
                    node.restart_at = loop.time() + cluster.restart_backoff_s * 2 ** node.restarts
            if node.restart_at is not None and loop.time() >= node.restart_at:
                node.restarts, node.restart_at, node.reported = node.restarts + 1, None, False
                print(f"pdserve: starting {node.node_id} again (restart {node.restarts} of "
                      f"{cluster.max_restarts})", file=sys.stderr, flush=True)
                node.start()
                backend.note_restart(node.node_id)
        await asyncio.sleep(0.2)


async def _first_request(config: RouterConfig, model_name: str) -> None:
    """Shows a newcomer the system working: one streamed completion, printed as it arrives."""
    import httpx

    url = f"http://{config.host}:{config.port}/v1/completions"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    body = {"model": config.served_model_name or model_name, "prompt": "ROMEO:\n", "max_tokens": 64,
            "temperature": 0.8, "seed": 0, "stream": True}
    print("pdserve: a first request, ROMEO:", flush=True)
    httpx_log = logging.getLogger("httpx")
    level = httpx_log.level
    httpx_log.setLevel(logging.WARNING)     # its "HTTP Request: POST ..." line read as the router calling itself
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        print(json.loads(line[6:])["choices"][0]["text"], end="", flush=True)
        print("\n", flush=True)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        print(f"pdserve: the first request failed: {e}", file=sys.stderr, flush=True)
    finally:
        httpx_log.setLevel(level)


def _print_ready(config: RouterConfig, model_name: str) -> None:
    url = f"http://{config.host}:{config.port}"
    auth = f" -H 'Authorization: Bearer {config.api_key}'" if config.api_key else ""
    body = f'{{"model": "{config.served_model_name or model_name}", "prompt": "ROMEO:", "max_tokens": 32}}'
    print(f"\npdserve is up at {url}  (Ctrl-C stops it and its nodes)\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n",
          flush=True)


# ------------------------------------------------------------ flags


def _parser() -> argparse.ArgumentParser:
    from node_shell.config import NodeConfig

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{up,router,prefill,decode,colocated,secret,nodes,drain,remove}")
    up_parser = sub.add_parser("up", help="router + prefill and decode node processes on this machine",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(up_parser, RouterConfig)
    add_dataclass_args(up_parser, ClusterConfig)
    nodes = up_parser.add_argument_group("engine and node flags (passed to every node when given)")
    add_dataclass_args(nodes, NodeConfig, dest_prefix="node_", skip=_PER_NODE_FIELDS)
    sub.add_parser("router", help="the router alone (up --prefill 0 --decode 0): nodes join from other hosts")
    sub.add_parser("prefill", help="one prefill node (python -m prefill_node)")
    sub.add_parser("decode", help="one decode node (python -m decode_node)")
    sub.add_parser("colocated", help="one process, prefill and decode together (python -m router)")
    sub.add_parser("secret", help="print a fresh cluster secret for nodes started by hand")
    sub.add_parser("nodes", help="list the router's nodes (operator API, needs the admin key)")
    sub.add_parser("drain", help="drain a node: no new work, running requests finish or move, then it leaves")
    sub.add_parser("remove", help="remove a node now: its requests move to other nodes")
    return parser


def _node_flags(args: dict[str, Any]) -> list[str]:
    """The node flags given, as node argv (the model is passed separately)."""
    flags = []
    for key, value in args.items():
        if key.startswith("node_") and key != "node_model":
            name = key[len("node_"):].replace("_", "-")
            flags += [f"--{name}" if value is True else f"--no-{name}"] if type(value) is bool \
                else [f"--{name}", str(value)]
    return flags


def _model_path(given: str | None) -> str:
    from engine.builtin import BUILTIN_MODEL_PATH

    path = os.path.abspath(given or BUILTIN_MODEL_PATH)
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = "" if given else " (build the built-in model with `python -m engine.builtin.train`)"
        sys.exit(f"pdserve: no model at {path}{hint}; pass --model DIR, a local Hugging Face folder")
    return path


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _PARENT_DEATH_SHIM, str(os.getpid()), *argv]


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)     # the node and anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
