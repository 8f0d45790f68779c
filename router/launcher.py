"""`pdserve`: start a disaggregated deployment on this machine, or the colocated server.

    pdserve up [--model DIR] [--prefill N] [--decode M] [--prefill-tp A] [--decode-tp B]
               [--host H] [--port P] [node flags]
    pdserve router [--model DIR] [router flags]     the router alone: nodes join from anywhere
    pdserve prefill|decode --router ENDPOINT --node-id ID [node flags]   one node
    pdserve colocated [flags of `python -m router`]
    pdserve secret             prints a fresh cluster secret (64 hex digits)
    pdserve nodes | drain NODE | remove NODE      the operator API (router/operator_cli.py)
    pdserve pools | scale --prefill N --decode M  the pools' sizes: nodes start or drain
    pdserve ray up --address auto [up flags]     the same deployment on a Ray cluster (ray_deploy/)
    pdserve profile [--model DIR] [node flags] | plan --profile P --workload W --rate R   (pdplan/cli.py)

A multi-host deployment: `(umask 077; pdserve secret > secret)`, copy the file to every
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
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import Any, NamedTuple, Sequence

from kvtransport.secret import ENV_VAR, SecretError, encode_secret, load_secret, new_secret
from engine.flags import add_dataclass_args, build_dataclass
from pdplan.autoscale_config import AutoscaleConfig
from router.config import RouterConfig, keys_from_environment
from router.node_fleet import NodeFleet
from router.node_processes import ClusterConfig, LocalFleet

# NodeConfig fields the launcher sets itself, per node, instead of taking them as flags
_PER_NODE_FIELDS = ("router", "node_id", "kv_bind", "tensor_parallel_size", "cluster_secret_file")


class UpArgs(NamedTuple):
    router: RouterConfig
    cluster: ClusterConfig
    model: str | None           # --model as given; None: the built-in model
    node_flags: list[str]       # the node flags given, as node argv, --model aside
    autoscale: AutoscaleConfig = AutoscaleConfig()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["colocated"]:
        from router.cli import main as colocated
        return colocated(argv[1:])
    if argv[:1] == ["secret"]:
        return print(encode_secret(new_secret()))
    if argv[:1] in (["prefill"], ["decode"]):
        return _node_main(argv[0], argv[1:])
    if argv[:1] in (["nodes"], ["drain"], ["remove"], ["pools"], ["scale"]):
        from router import operator_cli
        sys.exit(operator_cli.main(argv))
    if argv[:1] == ["ray"]:
        from ray_deploy.cli import main as ray_main      # needs the [ray] extra; `pdserve up` never imports ray
        sys.exit(ray_main(argv[1:]))
    if argv[:1] in (["profile"], ["plan"]):
        from pdplan.cli import main as planner_main
        return planner_main(argv)
    if argv[:1] == ["router"]:
        argv = ["up", *argv[1:], "--prefill", "0", "--decode", "0"]
    args = parse_up(argv)
    model = model_path(args.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    sys.exit(up(model, args.router, args.cluster, ["--model", model, *args.node_flags], autoscale=args.autoscale))


def parse_up(argv: Sequence[str]) -> UpArgs:
    """`up` and its flags; exits with a usage error for bad ones."""
    parser = _parser()
    args = vars(parser.parse_args(argv))
    try:
        router = build_dataclass(RouterConfig, keys_from_environment(args, os.environ))
        cluster = build_dataclass(ClusterConfig, args)
        autoscale = build_dataclass(AutoscaleConfig, args)
    except ValueError as err:
        parser.error(str(err))
    return UpArgs(router, cluster, args.get("node_model"), _node_flags(args), autoscale)


def up(model: str, router: RouterConfig, cluster: ClusterConfig, node_flags: list[str],
       fleet: NodeFleet | None = None, autoscale: AutoscaleConfig = AutoscaleConfig()) -> int:
    """Runs the deployment until Ctrl-C or SIGTERM; returns the exit status. fleet: who starts
    and supervises the nodes (default: processes on this machine, `pdserve up`); autoscale: the
    pools follow the router's own figures (--autoscale)."""
    import uvloop

    fleet = fleet if fleet is not None else LocalFleet(cluster, node_flags)
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return uvloop.run(_serve(model, router, cluster, fleet, autoscale))
    except KeyboardInterrupt:
        print("\npdserve: shutting down", flush=True)
        return 0
    finally:
        # A later SIGTERM (`timeout make run` sends one to make and one to us) must not cut the
        # nodes' stop short with a traceback; SIGKILL still ends everything.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)


async def _serve(model: str, config: RouterConfig, cluster: ClusterConfig, fleet: NodeFleet,
                 autoscale: AutoscaleConfig) -> int:
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
        fleet.start(endpoint, backend, secret)
        if not await fleet.wait_registered(backend):
            return 1
        app = create_app(backend, config)
        server = Server(app, config, log_level="info")   # bounded shutdown: router/http/server.py
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        watching = asyncio.create_task(fleet.supervise(backend))
        scaling = _autoscaler(autoscale, backend, app)
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        greeting = None
        if server.started:
            config = dataclasses.replace(config, port=sock.getsockname()[1])    # --port 0: the one given
            _print_ready(config, backend.model_name)
            if fleet.starts_nodes():    # a router alone waits for nodes from elsewhere: nothing to greet yet
                greeting = asyncio.create_task(_first_request(config, backend.model_name))
        await serving
        watching.cancel()
        if scaling is not None:
            scaling.cancel()
        if greeting is not None:
            greeting.cancel()
        return 0 if server.started else 1
    finally:
        backend.close()
        sock.close()


def _autoscaler(config: AutoscaleConfig, backend: Any, app: Any) -> asyncio.Task | None:
    """--autoscale: the pools follow the router's own figures (pdplan/autoscaler.py)."""
    if not config.autoscale:
        return None
    if backend.operator.scaler is None:
        sys.exit("pdserve: --autoscale needs nodes started here (a router alone cannot start any)")
    from pdplan.autoscaler import Autoscaler
    scaler = Autoscaler(config, backend.operator, backend.server.registry, app.state.metrics.registry,
                        backend.server.block_size or 16)
    return asyncio.create_task(scaler.run())


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
    auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if config.api_key else ""     # not the key: logs are read
    body = f'{{"model": "{config.served_model_name or model_name}", "prompt": "ROMEO:", "max_tokens": 32}}'
    print(f"\npdserve is up at {url}  (Ctrl-C stops it and its nodes)\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n",
          flush=True)


# ------------------------------------------------------------ flags


def _parser() -> argparse.ArgumentParser:
    from node_shell.config import NodeConfig

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{up,router,prefill,decode,colocated,secret,nodes,drain,remove,pools,scale,ray,profile,plan}")
    up_parser = sub.add_parser("up", help="router + prefill and decode node processes on this machine",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(up_parser, RouterConfig)
    add_dataclass_args(up_parser, ClusterConfig)
    add_dataclass_args(up_parser.add_argument_group("autoscaling (pdplan/autoscaler.py)"), AutoscaleConfig)
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
    sub.add_parser("pools", help="each pool's target and its active, draining and starting nodes")
    sub.add_parser("scale", help="resize the pools: --prefill N --decode M (new nodes start, the surplus drains)")
    sub.add_parser("ray", help="ray up: the router and its nodes on a Ray cluster; ray scale (pip install pdserve[ray])")
    sub.add_parser("profile", help="measure one node's step cost and block transfer into a JSON profile (pdplan)")
    sub.add_parser("plan", help="the P:D split and node counts that meet SLOs, from a profile (pdplan)")
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


def model_path(given: str | None) -> str:
    from engine.builtin import BUILTIN_MODEL_PATH

    path = os.path.abspath(given or BUILTIN_MODEL_PATH)
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = "" if given else " (build the built-in model with `python -m scripts.builtin_model.train`)"
        sys.exit(f"pdserve: no model at {path}{hint}; pass --model DIR, a local Hugging Face folder")
    return path


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
