"""RayScaler: the PoolScaler (router/cluster/pool_scaler.py) of a Ray deployment.

    count > live ──▶ new node actors (RayFleet.add), placed by Ray where the role's resources are
    count < live ──▶ first the surplus still starting is killed (newest first: it holds no work);
                     then the least busy registered nodes drain through the router's operator;
                     each says goodbye and exits 0 when done, and the fleet then kills its actor
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from router.cluster.pool_scaler import check_scale, live, surplus

if TYPE_CHECKING:
    from ray_deploy.fleet import RayFleet
    from router.cluster.node_operator import NodeOperator
    from router.cluster.registry import NodeRegistry
    from router.node_processes import ClusterConfig


class RayScaler:
    def __init__(self, fleet: RayFleet, registry: NodeRegistry, operator: NodeOperator, cluster: ClusterConfig):
        self._fleet, self._registry, self._operator = fleet, registry, operator
        self._max_pool_size = cluster.max_pool_size
        self._targets = {"prefill": cluster.prefill, "decode": cluster.decode}

    def targets(self) -> dict[str, int]:
        return dict(self._targets)

    def starting(self, role: str) -> int:
        return len(self._fleet.starting(role))

    async def scale(self, role: str, count: int, drain_deadline_s: float) -> None:
        check_scale(role, count, self._max_pool_size)
        self._targets[role] = count
        for _ in range(count - live(self._registry, self, role)):
            self._fleet.add(role)
        excess = live(self._registry, self, role) - count
        starting = self._fleet.starting(role)[::-1]
        for node in starting[:max(0, excess)]:
            self._fleet.retire(node)
            print(f"pdserve: scaling {role} to {count}: stopped {node.node_id} before it registered",
                  file=sys.stderr, flush=True)
        registered = live(self._registry, self, role) - len(self._fleet.starting(role))
        for node_id in surplus(self._registry, role, registered - max(0, excess - len(starting))):
            self._operator.drain(node_id, drain_deadline_s)
            print(f"pdserve: scaling {role} to {count}: draining {node_id}", file=sys.stderr, flush=True)
