"""FleetScaler's arithmetic (router/fleet_scaler.py) over a Ray-shaped fleet over a real NodeRegistry: how many actors it adds, which starting
actors it ends, which registered nodes it drains. The Ray side itself runs in test_ray_deploy.py."""
from __future__ import annotations

import asyncio

from ray_deploy.ray_node import ActorState, RayNode
from router.cluster.registry import NodeRegistry, NodeRole
from router.fleet_scaler import FleetScaler
from router.node_processes import ClusterConfig


class _Fleet:
    """The part of RayFleet the scaler drives, recording instead of talking to Ray."""

    def __init__(self, registry: NodeRegistry):
        self.registry, self.nodes, self.counts = registry, [], {"prefill": 0, "decode": 0}

    def add(self, role: str) -> RayNode:
        node = RayNode(f"{role}-{self.counts[role]}", role, actor=None)
        self.counts[role] += 1
        self.nodes.append(node)
        return node

    def retire(self, node: RayNode) -> None:
        node.state = ActorState.LEFT

    def starting(self, role: str) -> list[RayNode]:
        return [n for n in self.nodes if n.role == role and n.running and self.registry.get(n.node_id) is None]


class _Operator:
    def __init__(self, registry: NodeRegistry):
        self.registry, self.drained = registry, []

    def drain(self, node_id: str, deadline_s: float) -> None:
        self.registry.drain(node_id)
        self.drained.append(node_id)


def _setup(decode: int) -> tuple[NodeRegistry, _Fleet, _Operator, FleetScaler]:
    registry = NodeRegistry(heartbeat_timeout_s=60.0)
    fleet, operator = _Fleet(registry), _Operator(registry)
    for _ in range(decode):
        node = fleet.add("decode")
        registry.register(node.node_id, NodeRole.DECODE, f"tcp://127.0.0.3:{7000 + len(fleet.nodes)}")
    return registry, fleet, operator, FleetScaler(fleet, registry, operator, ClusterConfig(0, decode, max_pool_size=8))


def test_scaling_up_adds_actors_and_down_ends_starting_ones_before_draining_registered_ones():
    """2 registered -> 4: two new actors; -> 1 before they register: both end (newest first), then
    one registered node drains; nothing else changes."""
    registry, fleet, operator, scaler = _setup(decode=2)
    asyncio.run(scaler.scale("decode", 4, 5.0))
    assert [n.node_id for n in fleet.nodes] == ["decode-0", "decode-1", "decode-2", "decode-3"]
    assert (scaler.starting("decode"), scaler.targets()) == (2, {"prefill": 0, "decode": 4})
    asyncio.run(scaler.scale("decode", 1, 5.0))
    assert [n.state for n in fleet.nodes[2:]] == [ActorState.LEFT, ActorState.LEFT]
    assert operator.drained == ["decode-1"]
    assert scaler.starting("decode") == 0 and fleet.counts["decode"] == 4


def test_scaling_down_by_fewer_than_are_starting_drains_nothing():
    """2 registered + 1 starting -> 2: only the starting actor ends; the registered nodes serve on."""
    registry, fleet, operator, scaler = _setup(decode=2)
    asyncio.run(scaler.scale("decode", 3, 5.0))
    asyncio.run(scaler.scale("decode", 2, 5.0))
    assert [n.state for n in fleet.nodes] == [ActorState.RUNNING, ActorState.RUNNING, ActorState.LEFT]
    assert operator.drained == []
    asyncio.run(scaler.scale("decode", 2, 5.0))
    assert len(fleet.nodes) == 3 and operator.drained == []
