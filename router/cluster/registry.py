"""Node registry: the prefill and decode nodes the router may use, their liveness and load.

Fed by registrations and heartbeats; nodes join and leave at run time. Life of a node:

    register() ──▶ ACTIVE ──drain()──▶ DRAINING ──heartbeat finds it idle──▶ removed (reply LEAVE)
                     ▲                    │
                     └──── register() ────┘            (re-registering revives a node)

    any state ──no heartbeat for heartbeat_timeout_s──▶ removed by expire()
    any state ──remove()──▶ removed                     (the node deregistered itself)

Only ACTIVE nodes with a fresh heartbeat are candidates for new work. The router's own count of
work in flight on each node is kept here too, as bookings: heartbeats lag, bookings do not.

Life of a booking (what a node's load shows of it, `unreported` = what its last heartbeat lacks):

    book() ──▶ PENDING ──taken()──▶ TAKEN ──the node's next heartbeat──▶ shown in its load
      │  unreported += b    │  (the node has it)        unreported -= b (the heartbeat shows it)
      └──release()──────────┴──release(): unreported -= b   (gone from the node, or never there)

b is the router's estimate until taken(), which may replace it with what the node says it took
(a decode node's Reserved.taken_blocks): from then on b is that figure, and release() takes off
that, once. Until the next heartbeat a release can overstate the room it frees: a request that
pulled idle cached blocks into use (its b counts them) and ends while later requests share them
frees only its own tail on the node. Bounded by one heartbeat; the node's Busy guards it.
A booking is taken() and released on the control loop the moment the message that says so
reaches the router (a decode node's Reserved, its last TokenDelta, a node's RequestFailed, a
prefill node's FirstToken: router/cluster/bookings.py), before the heartbeats the node sent
after it (which show its effect) are handled.

A decode node's booking may carry prefill work too (p: the prompt blocks it computes itself, a
local prefill). A heartbeat reports sequences and blocks, not a queue of prefills, so p counts
(unreported_prefill_blocks) from book() until release() or the first heartbeat after taken(),
whichever comes first, and comes off exactly once: a release after that heartbeat takes off the
blocks and the sequence (freed since), not p again.
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
    inflight_requests: int = 0      # requests booked here that have not ended
    inflight_blocks: int = 0        # KV blocks of work those requests carry (decode: the prompt blocks it
                                    #   allocates, its cached overlap not; prefill: uncached blocks)
    pending_requests: int = 0       # booked, not yet taken by the node: no heartbeat shows them
    pending_blocks: int = 0
    since_beat_requests: int = 0    # taken less released since the last heartbeat (may be < 0):
    since_beat_blocks: int = 0      #   what the next heartbeat will show that the last did not
    pending_prefill_blocks: int = 0     # prefill work (Booking.prefill_blocks) booked, not yet taken
    since_beat_prefill_blocks: int = 0  # taken since the last heartbeat and not released (>= 0)
    beats: int = 0                  # heartbeats received: which one a taken booking's prefill work went with

    @property
    def unreported_requests(self) -> int:
        """Requests to add to the last heartbeat's load to get the node's load now."""
        return self.pending_requests + self.since_beat_requests

    @property
    def unreported_blocks(self) -> int:
        """Blocks to add to the last heartbeat's usage (negative: blocks freed since)."""
        return self.pending_blocks + self.since_beat_blocks

    @property
    def unreported_prefill_blocks(self) -> int:
        """Prompt blocks the node must still compute itself that its last heartbeat does not show."""
        return self.pending_prefill_blocks + self.since_beat_prefill_blocks


@dataclass(slots=True, eq=False)
class Booking:
    """One request's work on one node, from the moment the router chose the node until it ends."""
    node: Node
    blocks: int
    prefill_blocks: int = 0         # of its prompt, the blocks a decode node computes itself (local prefill)
    taken: bool = False             # the node has the work (it answered, or was sent it)
    released: bool = False
    taken_beat: int = 0             # node.beats when taken: a later heartbeat has shown its prefill work


class NodeRegistry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 on_capacity: Callable[[Node], None] = lambda node: None):
        """`on_capacity(node)` is called when the node may have more room: it registered, sent a
        heartbeat, or work it had taken was released."""
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self._timeout = heartbeat_timeout_s
        self._clock = clock
        self._on_capacity = on_capacity
        self._nodes: dict[str, Node] = {}

    def register(self, node_id: str, role: NodeRole, endpoint: str) -> Node:
        """Adds a node, or revives a known one (new endpoint, ACTIVE). A node keeps its role."""
        node = self._nodes.get(node_id)
        if node is not None and node.role is not role:
            raise ValueError(f"node {node_id!r} is registered as {node.role.value}, not {role.value}")
        if node is None:
            node = self._nodes[node_id] = Node(node_id, role, endpoint, self._clock())
        node.endpoint, node.state, node.last_seen = endpoint, NodeState.ACTIVE, self._clock()
        self._on_capacity(node)
        return node

    def heartbeat(self, node_id: str, load: NodeLoad) -> HeartbeatReply:
        node = self._nodes.get(node_id)
        if node is None:
            return HeartbeatReply.UNKNOWN
        node.load, node.last_seen = load, self._clock()
        node.since_beat_requests = node.since_beat_blocks = node.since_beat_prefill_blocks = 0
        node.beats += 1
        if node.state is NodeState.DRAINING and load.idle and node.inflight_requests == 0:
            del self._nodes[node_id]
            return HeartbeatReply.LEAVE
        self._on_capacity(node)
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

    def silence_s(self, node: Node) -> float:
        """Seconds since the node's last heartbeat or registration."""
        return self._clock() - node.last_seen

    def book(self, node_id: str, blocks: int, prefill_blocks: int = 0) -> Booking:
        """Counts one request of `blocks` blocks of work on the node, from now until release(), and
        `prefill_blocks` prompt blocks it computes itself until a heartbeat shows the request."""
        node = self._get(node_id)
        node.inflight_requests += 1
        node.inflight_blocks += blocks
        node.pending_requests += 1
        node.pending_blocks += blocks
        node.pending_prefill_blocks += prefill_blocks
        return Booking(node, blocks, prefill_blocks)

    def taken(self, booking: Booking, blocks: int | None = None, prefill_blocks: int | None = None) -> None:
        """The node has the work: its next heartbeat shows it. `blocks`, `prefill_blocks` (None:
        the booking's own): what the node says it took and must compute, which replace what was
        booked from then on (release() takes these off). Idempotent, and a no-op for a node
        removed (or re-registered: a new incarnation, a new Node) since: that node never had it."""
        node = booking.node
        if booking.taken or booking.released or self._nodes.get(node.node_id) is not node:
            return
        booking.taken, booking.taken_beat = True, node.beats
        node.pending_requests -= 1
        node.pending_blocks -= booking.blocks
        node.pending_prefill_blocks -= booking.prefill_blocks
        fewer = blocks is not None and blocks < booking.blocks
        if blocks is not None:
            node.inflight_blocks += blocks - booking.blocks
            booking.blocks = blocks
        if prefill_blocks is not None:
            booking.prefill_blocks = prefill_blocks
        node.since_beat_requests += 1
        node.since_beat_blocks += booking.blocks
        node.since_beat_prefill_blocks += booking.prefill_blocks
        if fewer:
            self._on_capacity(node)

    def release(self, booking: Booking) -> None:
        """Undoes book(); idempotent, and a no-op for a node removed (or re-registered) since."""
        if booking.released:
            return
        booking.released = True
        node = booking.node
        if self._nodes.get(node.node_id) is not node:
            return
        node.inflight_requests -= 1
        node.inflight_blocks -= booking.blocks
        if booking.taken:
            node.since_beat_requests -= 1
            node.since_beat_blocks -= booking.blocks
            if booking.taken_beat == node.beats:        # no heartbeat since it was taken
                node.since_beat_prefill_blocks -= booking.prefill_blocks
            self._on_capacity(node)
        else:
            node.pending_requests -= 1
            node.pending_blocks -= booking.blocks
            node.pending_prefill_blocks -= booking.prefill_blocks

    def _fresh(self, node: Node) -> bool:
        return self._clock() - node.last_seen <= self._timeout

    def _get(self, node_id: str) -> Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise KeyError(f"unknown node {node_id!r}")
        return node
