"""Node membership as the router sees it: a node as the operator lists it (NodeView), why a node
was lost (NodeLoss), and the pdserve_router_* series of joins, losses, drains, removals and
restarts (router/cluster/control_server.py and router/cluster/node_operator.py feed them; /metrics reads them).

    hello ──▶ registered (a join) ──▶ lost, with one LossCause:
                 │                      HEARTBEAT  silent for heartbeat_timeout_s
                 │                      RESTARTED  said hello with a new epoch
                 │                      GOODBYE    said goodbye on a clean exit
                 │                      EXITED     its supervisor saw its process end
                 │                      REMOVED    an operator removed it (told to leave)
                 └─ draining ─────────▶ DRAINED    idle, or its drain deadline passed (told to leave)
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, NamedTuple

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from router.cluster.registry import Node, NodeRole, NodeState


class LossCause(Enum):
    HEARTBEAT = "heartbeat"
    RESTARTED = "restarted"
    GOODBYE = "goodbye"
    EXITED = "exited"
    REMOVED = "removed"
    DRAINED = "drained"


DEFAULT_DRAIN_DEADLINE_S = 60.0  # a drained node's running requests move after this long
NODE_FAILURE = "node_failure"   # the cause label of a retry after a node's RequestFailed
BUSY = "busy"                   # ... and after a prefill node's Busy
OPERATOR_CAUSES = frozenset({LossCause.REMOVED.value, LossCause.DRAINED.value})    # an operator's: moves, not failures


class NodeLoss(NamedTuple):
    """Why a node's work will not finish there; str() is the log line's reason."""
    cause: LossCause
    detail: str = ""

    def __str__(self) -> str:
        text = _TEXT[self.cause]
        return f"{text} ({self.detail})" if self.detail else text


_TEXT = {LossCause.HEARTBEAT: "heartbeat timeout", LossCause.RESTARTED: "restarted",
         LossCause.GOODBYE: "said goodbye", LossCause.EXITED: "process exited",
         LossCause.REMOVED: "removed by an operator", LossCause.DRAINED: "drained"}


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the operator API lists it."""
    id: str
    role: str                       # "prefill" | "decode"
    state: str                      # "active" | "draining" | "removed" | "drained" (the answers to a remove)
    epoch: str                      # the node process's incarnation (a restart makes a new one)
    address: str                    # decode: its KV endpoint, where prefill nodes ship blocks; prefill: ""
    num_running: int                # from its last heartbeat
    num_waiting: int
    kv_usage: float                 # fraction of KV blocks in use, 0..1
    num_free_blocks: int
    num_blocks: int                 # its KV pool, as its hello said
    booked_requests: int            # the router's requests on it that have not ended
    last_heartbeat_age_s: float     # since its last heartbeat (or hello)
    drain_deadline_s: float | None  # draining: seconds until its requests are moved; else None


class MembershipMetrics:
    """The router's membership counters, and a gauge of the registry's nodes read at scrape time."""

    def __init__(self, nodes: Callable[[], list[Node]]):
        self.joins = Counter("pdserve_router_node_joins", "Node registrations (one per node epoch).",
                             registry=None)
        self.goodbyes = Counter("pdserve_router_node_goodbyes", "Goodbyes nodes said on a clean exit.",
                                registry=None)
        self.losses = Counter("pdserve_router_node_losses", "Nodes taken out, by cause.", ["cause"],
                              registry=None)
        self.drains = Counter("pdserve_router_node_drains", "Drains an operator started.", registry=None)
        self.removals = Counter("pdserve_router_node_removals", "Nodes an operator removed.", registry=None)
        self.restarts = Counter("pdserve_router_node_restarts", "Node processes a supervisor restarted.",
                                ["node"], registry=None)
        self.gauge = NodeGauge(nodes)

    def collectors(self) -> tuple:
        return (self.joins, self.goodbyes, self.losses, self.drains, self.removals, self.restarts, self.gauge)


class NodeGauge:
    """pdserve_router_nodes{role, state}: every role and state, 0 included."""

    def __init__(self, nodes: Callable[[], list[Node]]):
        self._nodes = nodes

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("pdserve_router_nodes", "Registered nodes, by role and state.",
                                   labels=["role", "state"])
        nodes = self._nodes()
        for role in NodeRole:
            for state in NodeState:
                count = sum(1 for n in nodes if n.role is role and n.state is state)
                family.add_metric([role.value, state.value], count)
        yield family
