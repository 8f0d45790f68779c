"""Node registry: the prefill and decode nodes the router may use, their liveness and load.

Fed by registrations and heartbeats; nodes join and leave at run time. Life of a node:

    register() ──▶ ACTIVE ──drain()──▶ DRAINING ──heartbeat finds it idle──▶ removed (reply LEAVE)
                     ▲                    │
                     └──── register() ────┘            (re-registering revives a node)

    any state ──no heartbeat for heartbeat_timeout_s──▶ removed by expire()
    any state ──remove()──▶ removed                     (the node deregistered itself)

Only ACTIVE nodes with a fresh heartbeat are candidates for new work. The router's own count of
work in flight on each node (begin/end) is kept here too: heartbeats lag, this does not.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, NamedTuple


class NodeRole(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class NodeState(Enum):
    ACTIVE = "active"
    DRAINING = "draining"   # finishes the work it has, gets none new, then leaves


class HeartbeatReply(Enum):
    OK = "ok"
    UNKNOWN = "unknown"     # not registered (expired or never seen): the node must register again
    LEAVE = "leave"         # drained and idle: the node has been removed and may shut down


class NodeLoad(NamedTuple):
    """Load a node reports in its heartbeat."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0   # fraction of KV blocks in use, 0..1

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0


@dataclass(slots=True)
class Node:
    node_id: str
    role: NodeRole
    endpoint: str                   # where the node listens, e.g. "tcp://127.0.0.1:5601"
    last_seen: float                # clock() at the last registration or heartbeat
    state: NodeState = NodeState.ACTIVE
    load: NodeLoad = field(default_factory=NodeLoad)
    inflight_requests: int = 0      # requests the router sent here that have not ended
    inflight_blocks: int = 0        # KV blocks of work those requests carry (prefill: uncached blocks)


class NodeRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self._timeout = heartbeat_timeout_s
        self._clock = clock
        self._nodes: dict[str, Node] = {}

    def register(self, node_id: str, role: NodeRole, endpoint: str) -> Node:
        """Adds a node, or revives a known one (new endpoint, ACTIVE). A node keeps its role."""
        node = self._nodes.get(node_id)
        if node is not None and node.role is not role:
            raise ValueError(f"node {node_id!r} is registered as {node.role.value}, not {role.value}")
        if node is None:
            node = self._nodes[node_id] = Node(node_id, role, endpoint, self._clock())
        node.endpoint, node.state, node.last_seen = endpoint, NodeState.ACTIVE, self._clock()
        return node

    def heartbeat(self, node_id: str, load: NodeLoad) -> HeartbeatReply:
        node = self._nodes.get(node_id)
        if node is None:
            return HeartbeatReply.UNKNOWN
        node.load, node.last_seen = load, self._clock()
        if node.state is NodeState.DRAINING and load.idle and node.inflight_requests == 0:
            del self._nodes[node_id]
            return HeartbeatReply.LEAVE
        return HeartbeatReply.OK

    def drain(self, node_id: str) -> None:
        """Stops new work going to the node; it leaves at its first idle heartbeat. KeyError if unknown."""
        self._get(node_id).state = NodeState.DRAINING

    def remove(self, node_id: str) -> bool:
        """Forgets the node at once; returns whether it was known."""
        return self._nodes.pop(node_id, None) is not None

    def expire(self) -> list[str]:
        """Removes every node silent for longer than the heartbeat timeout; returns their ids."""
        dead = [n.node_id for n in self._nodes.values() if not self._fresh(n)]
        for node_id in dead:
            del self._nodes[node_id]
        return dead

    def candidates(self, role: NodeRole) -> list[Node]:
        """ACTIVE nodes of `role` with a fresh heartbeat, by node id."""
        return [n for n in self.nodes(role) if n.state is NodeState.ACTIVE and self._fresh(n)]

    def nodes(self, role: NodeRole | None = None) -> list[Node]:
        """Every known node (of `role`), by node id."""
        return sorted((n for n in self._nodes.values() if role is None or n.role is role),
                      key=lambda n: n.node_id)

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def begin(self, node_id: str, blocks: int) -> None:
        """Counts one request of `blocks` blocks of work as in flight on the node."""
        node = self._get(node_id)
        node.inflight_requests += 1
        node.inflight_blocks += blocks

    def end(self, node_id: str, blocks: int) -> None:
        """Undoes begin(); a no-op for a node already removed."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.inflight_requests = max(0, node.inflight_requests - 1)
            node.inflight_blocks = max(0, node.inflight_blocks - blocks)

    def _fresh(self, node: Node) -> bool:
        return self._clock() - node.last_seen <= self._timeout

    def _get(self, node_id: str) -> Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise KeyError(f"unknown node {node_id!r}")
        return node
