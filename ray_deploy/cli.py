"""`pdserve ray ...`: the deployment of `pdserve up` on a Ray cluster.

    pdserve ray up [--address auto] [--name pdserve] [--cpus-per-rank C] [--gpus auto|yes|no]
                   [every flag of `pdserve up`: --prefill N --decode M --prefill-tp A --decode-tp B,
                    --model DIR, router and node flags]
    pdserve ray scale [--prefill N] [--decode M] --url URL [--admin-key-file F]
    pdserve ray pools --url URL [--admin-key-file F]

`ray up` connects to the cluster, serves the router in this process (it stays in the foreground;
Ctrl-C stops the deployment) and places every node as a Ray actor (ray_deploy/fleet.py). The
router's control plane binds this host's Ray address (unless --control-endpoint is given), and
each node binds and advertises the address of the host it landed on. The model folder must be at
the same path on every host, and pdserve installed in the same Python environment.
`ray scale` and `ray pools` are `pdserve scale` and `pdserve pools`: the operator API
(/admin/pools, needs the router's admin key, $PDSERVE_ADMIN_KEY), which resizes pools through its FleetScaler (router/fleet_scaler.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Sequence

from engine.flags import add_dataclass_args, build_dataclass
from ray_deploy.config import RayConfig


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] in (["scale"], ["pools"]):
        from router import operator_cli
        return operator_cli.main(argv)
    if argv[:1] != ["up"]:
        print("usage: pdserve ray up [flags] | pdserve ray scale --prefill N --decode M | pdserve ray pools",
              file=sys.stderr)
        return 2
    config, up_argv = parse(argv[1:])
    return up(config, up_argv)


def parse(argv: list[str]) -> tuple[RayConfig, list[str]]:
    """The Ray flags, and the rest as `pdserve up` argv."""
    parser = argparse.ArgumentParser(prog="pdserve ray up", add_help=False, allow_abbrev=False,
                                     description="The Ray flags; every flag of `pdserve up` follows.")
    add_dataclass_args(parser, RayConfig)
    if "-h" in argv or "--help" in argv:
        parser.print_help()         # then `pdserve up`'s own help, from parse_up
    known, rest = parser.parse_known_args(argv)
    try:
        return build_dataclass(RayConfig, vars(known)), ["up", *rest]
    except ValueError as err:
        parser.error(str(err))


def up(config: RayConfig, up_argv: list[str]) -> int:
    import logging

    import ray

    from ray_deploy.fleet import RayFleet
    from ray_deploy.node_actor import tcp_endpoint
    from router import launcher
    from router.config import KEY_VARIABLES

    args = launcher.parse_up(up_argv)
    model = launcher.model_path(args.model)
    node_flags = ["--model", model, *args.node_flags]
    for variable in KEY_VARIABLES.values():     # read into args.router; a local Ray runtime would inherit them
        os.environ.pop(variable, None)
    ray.init(address=None if config.address == "local" else config.address, namespace="pdserve",
             log_to_driver=True)
    try:
        router = args.router
        if not any(a.startswith("--control-endpoint") for a in up_argv):   # other hosts reach it at this host's Ray address
            router = replace(router, control_endpoint=tcp_endpoint(ray.util.get_node_ip_address(), 0))
        logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
        return launcher.up(model, router, args.cluster, node_flags, RayFleet(args.cluster, node_flags, config),
                           autoscale=args.autoscale)
    finally:
        ray.shutdown()
