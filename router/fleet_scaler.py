"""FleetScaler: the PoolScaler (router/cluster/pool_scaler.py) of a deployment whose fleet starts
its nodes: node processes on this machine (`pdserve up`, router/node_processes.py LocalFleet) or
Ray actors (`pdserve ray up`, ray_deploy/fleet.py RayFleet).

    count > live ──▶ the fleet adds count - live nodes (next unused ids); they join as any node does
    count < live ──▶ first the surplus still starting is retired, newest first (it holds no work,
                     while a registered node has a warm prefix cache); then the least busy
                     registered nodes drain through the router's operator: each says goodbye and
                     exits 0 when done, and the fleet does not start it again
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol

from router.cluster.pool_scaler import check_scale, live, surplus

if TYPE_CHECKING:
    from router.cluster.node_operator import NodeOperator
    from router.cluster.registry import NodeRegistry
    from router.node_processes import ClusterConfig


class ScalableFleet(Protocol):
    def add(self, role: str) -> Any:
        """Starts a node of `role` with the role's next unused id; returns it (it has .node_id)."""

    def starting(self, role: str) -> list[Any]:
        """Its running nodes of `role` not registered (yet, or again after a restart), oldest first."""

    def retire(self, node: Any) -> None:
        """Stops the node for good: never started again."""


class FleetScaler:
    def __init__(self, fleet: ScalableFleet, registry: NodeRegistry, operator: NodeOperator, cluster: ClusterConfig):
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
            node = self._fleet.add(role)
            _say(role, count, f"started {node.node_id}")
        starting = self._fleet.starting(role)
        keep_starting = max(0, count - (live(self._registry, self, role) - len(starting)))
        for node in starting[keep_starting:]:
            self._fleet.retire(node)
            _say(role, count, f"stopped {node.node_id} before it registered")
        for node_id in surplus(self._registry, role, count - min(keep_starting, len(starting))):
            self._operator.drain(node_id, drain_deadline_s)
            _say(role, count, f"draining {node_id}")


def _say(role: str, count: int, what: str) -> None:
    print(f"pdserve: scaling {role} to {count}: {what}", file=sys.stderr, flush=True)
