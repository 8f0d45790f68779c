"""Where Ray may put a node: the resources its actor holds.

    the cluster has GPUs (or --gpus yes) ──▶ tp GPUs and tp x cpus_per_rank CPUs
    otherwise                           ──▶ tp x cpus_per_rank CPUs
    the cluster offers a resource named after the role ("prefill", "decode") ──▶ 1 of it too,
        so an operator dedicates hosts to a pool: `ray start --resources '{"decode": 4}'`

A node's ranks are processes its node process starts, so one actor holds them all: one resource
request, which Ray grants on one host only, keeps a node's ranks together, as a STRICT_PACK
placement group of one bundle would, and lets Ray reschedule the actor alone when its host dies.
The actor spreads over hosts (SPREAD) so one host's death takes as few nodes of a pool as it can.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ray_deploy.config import RayConfig


class NodePlacement(NamedTuple):
    num_cpus: float
    num_gpus: int
    resources: dict[str, float]      # custom resources: {"decode": 1.0} or {}

    def actor_options(self, name: str, max_restarts: int) -> dict[str, Any]:
        """Options for `NodeActor.options(...)`: restarted at most max_restarts times by Ray."""
        return dict(name=name, namespace="pdserve", num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                    resources=self.resources, max_restarts=max_restarts, max_task_retries=0,
                    max_concurrency=4, scheduling_strategy="SPREAD")

    @property
    def threads(self) -> int:
        """OpenMP threads of the node process: its CPUs, at least one."""
        return max(1, int(self.num_cpus))

    def __str__(self) -> str:
        held = [f"{self.num_cpus:g} CPU"] + ([f"{self.num_gpus} GPU"] if self.num_gpus else []) + \
               [f"{amount:g} {name}" for name, amount in self.resources.items()]
        return " + ".join(held)


def place(role: str, tp: int, cluster_resources: dict[str, float], config: RayConfig) -> NodePlacement:
    """The placement of a node of `role` with `tp` ranks on a cluster offering `cluster_resources`
    (ray.cluster_resources())."""
    gpus = config.gpus == "yes" or (config.gpus == "auto" and cluster_resources.get("GPU", 0) > 0)
    resources = {role: 1.0} if cluster_resources.get(role, 0) > 0 else {}
    return NodePlacement(config.cpus_per_rank * tp, tp if gpus else 0, resources)
