"""How a deployment grows and shrinks its pools at run time, and what every deployment shares.

The operator API (POST /admin/pools/{role}), `pdserve scale` and an autoscaler call
PoolScaler.scale(role, count); whatever started the nodes implements it (pdserve up: node
processes on this machine, router/local_scaler.py; a Ray deployment: actors):

    count > live ──▶ start count - live new nodes; they join as any node does (hello, epoch)
    count < live ──▶ drain the surplus (surplus(): the least busy active nodes of the role); each
                     leaves when idle, or when its drain deadline passes its requests move; no
                     request fails and no block leaks
    live = the role's active (not draining) registered nodes + the nodes started and not yet
           registered

A router started alone (`pdserve router`) has no scaler: its nodes are started by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.cluster.registry import NodeRole, NodeState

if TYPE_CHECKING:
    from router.cluster.registry import Node, NodeRegistry

ROLES = tuple(role.value for role in NodeRole)      # ("prefill", "decode")


class NoScaler(RuntimeError):
    """This router's nodes were started by hand: nothing here can start more."""


class PoolScaler(Protocol):
    def targets(self) -> dict[str, int]:
        """The node count each role's pool was last asked for, by role."""

    def starting(self, role: str) -> int:
        """Nodes of the role started and not yet registered."""

    async def scale(self, role: str, count: int, drain_deadline_s: float) -> None:
        """Starts or drains nodes until the role's pool holds `count`; ValueError for a role or
        count this deployment refuses (over its pool-size limit), before anything changes."""


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool as the operator API lists it."""
    role: str
    target: int | None          # what the pool was last scaled to; None: no scaler
    active: int                 # registered, taking new work
    draining: int               # registered, finishing its work before it leaves
    starting: int               # started by the scaler, not registered yet


def pool_views(registry: NodeRegistry, scaler: PoolScaler | None) -> list[PoolView]:
    targets = scaler.targets() if scaler is not None else {}
    views = []
    for role in NodeRole:
        nodes = registry.nodes(role)
        views.append(PoolView(role.value, targets.get(role.value), _count(nodes, NodeState.ACTIVE),
                              _count(nodes, NodeState.DRAINING),
                              scaler.starting(role.value) if scaler is not None else 0))
    return views


def check_scale(role: str, count: int, max_pool_size: int) -> None:
    """ValueError naming what is wrong with a scale request."""
    if role not in ROLES:
        raise ValueError(f"no pool {role[:32]!r}: the pools are {', '.join(ROLES)}")
    if not 0 <= count <= max_pool_size:
        raise ValueError(f"a {role} pool holds 0 to {max_pool_size} nodes (--max-pool-size), not {count}")


def surplus(registry: NodeRegistry, role: str, keep: int) -> list[str]:
    """The ids of the active nodes of `role` to drain so that `keep` stay: the least busy first
    (fewest booked requests, then the most free KV), the newest id first among equals."""
    active = [n for n in registry.nodes(NodeRole(role)) if n.state is NodeState.ACTIVE]
    active.sort(key=lambda n: (n.inflight_requests, n.load.kv_usage, _newest_first(n.node_id)))
    return [n.node_id for n in active[:max(0, len(active) - keep)]]


def live(registry: NodeRegistry, scaler: PoolScaler, role: str) -> int:
    return _count(registry.nodes(NodeRole(role)), NodeState.ACTIVE) + scaler.starting(role)


def _count(nodes: list[Node], state: NodeState) -> int:
    return sum(1 for n in nodes if n.state is state)


def _newest_first(node_id: str) -> tuple[int, str]:
    """decode-10 sorts before decode-9: the node added last goes first."""
    stem, _, number = node_id.rpartition("-")
    return (-int(number), stem) if number.isdigit() else (0, node_id)
