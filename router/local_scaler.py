"""The PoolScaler of `pdserve up`: its pools are node processes on this machine.

Scaling up starts new node processes (NodeSpawner, next unused id) into the list the supervisor
watches, so they are restarted like the first ones if they die; scaling down first stops nodes
still starting, newest first (they hold no work, while a registered node has a warm prefix
cache), then drains the surplus through the router's operator
(router/cluster/pool_scaler.py): a drained node says goodbye and exits 0, which the supervisor
does not restart.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from router.cluster.pool_scaler import check_scale, live, surplus

if TYPE_CHECKING:
    from router.cluster.node_operator import NodeOperator
    from router.cluster.registry import NodeRegistry
    from router.node_processes import ClusterConfig, NodeProcess, NodeSpawner


class LocalScaler:
    def __init__(self, spawner: NodeSpawner, nodes: list[NodeProcess], operator: NodeOperator,
                 registry: NodeRegistry, cluster: ClusterConfig):
        """nodes: the list the supervisor watches; new nodes are appended to it."""
        self._spawner, self._nodes, self._operator, self._registry = spawner, nodes, operator, registry
        self._max_pool_size = cluster.max_pool_size
        self._targets = {"prefill": cluster.prefill, "decode": cluster.decode}

    def targets(self) -> dict[str, int]:
        return dict(self._targets)

    def starting(self, role: str) -> int:
        return len(self._starting(role))

    async def scale(self, role: str, count: int, drain_deadline_s: float) -> None:
        check_scale(role, count, self._max_pool_size)
        self._targets[role] = count
        missing = count - live(self._registry, self, role)
        for _ in range(missing):
            node = self._spawner.spawn(role)
            self._nodes.append(node)
            print(f"pdserve: scaling {role} to {count}: started {node.node_id}", file=sys.stderr, flush=True)
        starting = self._starting(role)
        keep_starting = max(0, count - (live(self._registry, self, role) - len(starting)))
        for node in starting[keep_starting:]:
            node.retire()       # not registered yet: it holds no work; registered nodes go first
        for node_id in surplus(self._registry, role, count - min(keep_starting, len(starting))):
            self._operator.drain(node_id, drain_deadline_s)
            print(f"pdserve: scaling {role} to {count}: draining {node_id}", file=sys.stderr, flush=True)

    def _starting(self, role: str) -> list[NodeProcess]:
        """Started, running, not registered yet (restarts of a registered node included)."""
        return [n for n in self._nodes if n.role == role and n.process.poll() is None
                and self._registry.get(n.node_id) is None]

