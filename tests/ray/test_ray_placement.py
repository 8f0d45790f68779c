"""What a Ray deployment asks of the cluster, and what it hands a node, without a cluster."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ray_deploy.cli import parse
from ray_deploy.config import RayConfig
from ray_deploy.node_actor import NodeLaunch, node_argv
from ray_deploy.placement import place
from router.node_processes import ClusterConfig
from tests.ray.ray_harness import REPO

CPU_CLUSTER = {"CPU": 8.0, "memory": 1e10}
POOLED_GPU_CLUSTER = {"CPU": 32.0, "GPU": 8.0, "prefill": 4.0, "decode": 4.0}


def test_gpu_nodes_hold_one_gpu_per_rank_and_their_pool_resource():
    """On a GPU cluster with pool resources, a tp=2 decode node holds 2 GPUs, 2 CPUs and 1 decode."""
    placement = place("decode", 2, POOLED_GPU_CLUSTER, RayConfig())
    assert placement == (2.0, 2, {"decode": 1.0})
    options = placement.actor_options("pdserve:decode-0", 3)
    assert (options["num_gpus"], options["resources"], options["max_restarts"]) == (2, {"decode": 1.0}, 3)
    assert options["name"] == "pdserve:decode-0" and options["max_task_retries"] == 0
    assert str(placement) == "2 CPU + 2 GPU + 1 decode"


def test_cpu_nodes_hold_cpus_per_rank_and_no_pool_resource_the_cluster_lacks():
    """Without GPUs or pool resources: tp x cpus_per_rank CPUs only, and as many threads."""
    placement = place("prefill", 3, CPU_CLUSTER, RayConfig(cpus_per_rank=2))
    assert placement == (6.0, 0, {})
    assert placement.threads == 6
    assert place("prefill", 1, POOLED_GPU_CLUSTER, RayConfig(gpus="no")).num_gpus == 0


def test_a_decode_node_binds_and_advertises_the_host_ray_placed_it_on():
    """The node's argv names its host for KV and p2p."""
    launch = NodeLaunch("decode", "decode-3", "tcp://10.0.0.1:7100", ("--model", "/m"), "secret-ref", 2)
    argv = node_argv(launch, "10.0.0.7")
    assert argv[1:7] == ["-m", "decode_node", "--router", "tcp://10.0.0.1:7100", "--node-id", "decode-3"]
    assert argv[-6:] == ["--p2p-host", "10.0.0.7", "--kv-bind", "tcp://10.0.0.7:0", "--kv-advertise-host", "10.0.0.7"]
    prefill = node_argv(launch._replace(role="prefill"), "fd00::7")
    assert "--kv-bind" not in prefill and prefill[-2:] == ["--p2p-host", "fd00::7"]


def test_a_node_actor_gets_the_cluster_secret_by_reference_not_as_an_argument(monkeypatch):
    """Ray keeps an actor's arguments in its control store for restarts (the GCS's tables; Redis
    when fault tolerant): the fleet puts the secret in Ray's object store once and hands each node
    actor only the reference (the secret was an argument)."""
    import ray_deploy.fleet as fleet_module

    secret, stored, launches = bytes(range(32)), [], []
    monkeypatch.setattr(fleet_module.ray, "put", lambda value: stored.append(value) or "secret-ref")
    monkeypatch.setattr(fleet_module.ray, "cluster_resources", lambda: CPU_CLUSTER)
    actor_class = SimpleNamespace(options=lambda **options: SimpleNamespace(remote=launches.append))
    monkeypatch.setattr(fleet_module.ray, "remote", lambda cls: actor_class)

    async def start() -> None:
        fleet = fleet_module.RayFleet(ClusterConfig(prefill=1, decode=2), ["--model", "/m"], RayConfig())
        fleet.start("tcp://10.0.0.1:7100", SimpleNamespace(server=SimpleNamespace(registry=None),
                                                            operator=SimpleNamespace()), secret)
        for node in fleet.nodes:
            node.watch.cancel()         # before it runs: there is no actor to watch
    asyncio.run(start())
    assert stored == [secret.hex()]
    assert [launch.secret for launch in launches] == ["secret-ref"] * 3
    assert not any(secret.hex() in repr(launch) for launch in launches)


def test_ray_flags_are_taken_out_and_the_rest_is_pdserve_up():
    """`pdserve ray up` parses its own flags and passes every other flag to `pdserve up`."""
    config, rest = parse(["--address", "10.0.0.1:6379", "--prefill", "2", "--gpus", "no", "--decode-tp", "2",
                          "--name", "blue", "--dtype", "float32"])
    assert config == RayConfig(address="10.0.0.1:6379", name="blue", gpus="no")
    assert rest == ["up", "--prefill", "2", "--decode-tp", "2", "--dtype", "float32"]
    with pytest.raises(ValueError):
        RayConfig(name="a b")


def test_pdserve_up_and_the_router_never_import_ray():
    """ray is an optional extra: the launcher, `pdserve up`'s parsing and the router load without it."""
    code = ("import sys; from router.launcher import parse_up; parse_up(['up']); "
            "import router.http.app, router.cluster.disaggregated; print('ray' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
