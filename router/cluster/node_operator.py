"""What an operator does to the nodes of a disaggregated router: list, drain, remove.

    drain(node, deadline_s) ──▶ DRAINING: no new work; its running requests go on
        ├─ idle at a heartbeat ─────────▶ told "leave" (registry), lost as DRAINED ("idle")
        └─ deadline_s passes, still busy ─▶ take out, lost as DRAINED
    remove(node) ──▶ take out at once, lost as REMOVED; answered once the node is out
    take out: a decode node's decoding requests first move to other decode nodes with their KV
              blocks (router/cluster/kv_move.py; the node is DRAINING meanwhile), for at most
              2 x kv_move_timeout_s (each move's end wakes the take-out: no poll); then the node
              is told "leave" and lost: whatever is still there moves re-prefilled from prompt +
              emitted tokens, as a prefill node's requests do
    a node told to leave says goodbye and exits; adding a node is starting one
    scale(role, count) ──▶ the deployment's PoolScaler starts nodes, or drains the surplus
                           (router/cluster/pool_scaler.py); no scaler: the nodes are started by hand

Everything runs on the backend's event loop; nothing here blocks.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Protocol

from router.cluster.control_server import ControlServer
from router.cluster.membership import DEFAULT_DRAIN_DEADLINE_S, LossCause, NodeLoss, NodeView
from router.cluster.pool_scaler import NoScaler, PoolScaler, PoolView, pool_views
from router.cluster.registry import Node, NodeRole, NodeState


class Evacuation(Protocol):
    """Moves a node's running requests off it before it is told to leave (router/cluster/kv_move.py)."""

    def start(self, node_id: str, loss: NodeLoss) -> bool:
        """Starts moving them; False if there is nothing to move."""

    async def settled(self, node_id: str) -> None:
        """Returns once no move off the node is under way (the caller bounds the wait)."""


class NodeOperator:
    def __init__(self, server: ControlServer, evacuation: Evacuation | None = None, wait_s: float = 10.0):
        self._server = server
        self._evacuation, self._wait_s = evacuation, wait_s     # wait_s: longest evacuation
        self._deadlines: dict[str, tuple[str, asyncio.TimerHandle]] = {}   # node id -> (epoch, timer)
        self._evacuating: dict[str, asyncio.Task] = {}          # node id -> its take-out
        self.scaler: PoolScaler | None = None       # set by the deployment that starts the nodes
        self._closed = False

    def nodes(self) -> list[NodeView]:
        """Every registered node, by id."""
        return [self._view(node) for node in self._server.registry.nodes()]

    def node(self, node_id: str) -> NodeView:
        """KeyError if the node is not registered."""
        node = self._server.registry.get(node_id)
        if node is None or self._server.info(node_id) is None:
            raise KeyError(f"unknown node {node_id!r}")
        return self._view(node)

    def drain(self, node_id: str, deadline_s: float = DEFAULT_DRAIN_DEADLINE_S) -> NodeView:
        """Starts (or re-times) the node's drain; KeyError if unknown. Call on the event loop."""
        epoch = self.node(node_id).epoch
        self._server.drain(node_id)
        self._cancel(node_id)
        timer = asyncio.get_running_loop().call_later(deadline_s, self._deadline_passed, node_id, epoch, deadline_s)
        self._deadlines[node_id] = (epoch, timer)
        self._server.membership.drains.inc()
        return self.node(node_id)

    async def remove(self, node_id: str) -> NodeView:
        """Moves the node's requests now (a decode node's with their KV blocks first), tells it to
        leave, and returns once it is out (state "removed"): at once, or after its KV moves (at
        most 2 x kv_move_timeout_s); KeyError if unknown. A remove that finds the node already
        being taken out by its drain deadline waits for that take-out, counts no removal, and
        answers state "drained" (the loss recorded)."""
        view = self.node(node_id)
        self._cancel(node_id)
        started = self._take_out(node_id, NodeLoss(LossCause.REMOVED))
        if started:
            self._server.membership.removals.inc()
        if (task := self._evacuating.get(node_id)) is not None:
            await asyncio.shield(task)      # a caller that gives up does not stop the take-out
        return replace(view, state="removed" if started else "drained", drain_deadline_s=None)

    def pools(self) -> list[PoolView]:
        return pool_views(self._server.registry, self.scaler)

    async def scale(self, role: str, count: int, drain_deadline_s: float = DEFAULT_DRAIN_DEADLINE_S) -> PoolView:
        """The role's pool to `count` nodes; NoScaler without a scaler, ValueError for a refused
        role or count."""
        if self.scaler is None:
            raise NoScaler("this router does not start nodes itself (pdserve router): start nodes with "
                           "`pdserve prefill|decode`, or deploy with `pdserve up` or `pdserve ray up`")
        await self.scaler.scale(role, count, drain_deadline_s)
        return next(view for view in self.pools() if view.role == role)

    def note_restart(self, node_id: str) -> None:
        """A supervisor restarted the node's process (counted in pdserve_router_node_restarts)."""
        self._server.membership.restarts.labels(node_id).inc()

    def close(self) -> None:
        self._closed = True     # a take-out whose wait the router's close also ended may not see the cancel
        for node_id in list(self._deadlines):
            self._cancel(node_id)
        for task in self._evacuating.values():
            task.cancel()

    def _deadline_passed(self, node_id: str, epoch: str, deadline_s: float) -> None:
        self._deadlines.pop(node_id, None)
        info, node = self._server.info(node_id), self._server.registry.get(node_id)
        if info is None or node is None or info.hello.epoch != epoch or node.state is not NodeState.DRAINING:
            return      # gone already (idle), or back as a new incarnation
        self._take_out(node_id, NodeLoss(LossCause.DRAINED, f"its {deadline_s:g} s drain deadline passed"))

    def _take_out(self, node_id: str, loss: NodeLoss) -> bool:
        """Removes the node now, or, when requests move off it with their KV blocks, once they have
        (the node takes no new work meanwhile); False if a take-out was under way already."""
        if node_id in self._evacuating:
            return False
        node = self._server.registry.get(node_id)
        if node is None or node.role is not NodeRole.DECODE or self._evacuation is None \
                or not self._evacuation.start(node_id, loss):
            self._server.remove(node_id, loss)
            return True
        self._server.drain(node_id, loss)    # if it goes idle before its blocks have moved: lost as `loss`
        epoch = self._server.info(node_id).hello.epoch
        task = asyncio.get_running_loop().create_task(self._remove_when_moved(node_id, epoch, loss))
        self._evacuating[node_id] = task
        return True

    async def _remove_when_moved(self, node_id: str, epoch: str, loss: NodeLoss) -> None:
        try:
            await asyncio.wait_for(self._evacuation.settled(node_id), self._wait_s)
        except TimeoutError:
            pass            # what is still there moves re-prefilled once the node is lost
        finally:
            self._evacuating.pop(node_id, None)
        if self._closed:        # (wait_for returns a wait that finished beside the cancel): it stops here
            return
        info = self._server.info(node_id)
        if info is not None and info.hello.epoch == epoch:
            self._server.remove(node_id, loss)

    def _cancel(self, node_id: str) -> None:
        entry = self._deadlines.pop(node_id, None)
        if entry is not None:
            entry[1].cancel()

    def _view(self, node: Node) -> NodeView:
        info = self._server.info(node.node_id)
        status = info.status if info is not None else None
        num_blocks = info.hello.num_blocks if info is not None else 0
        entry = self._deadlines.get(node.node_id)
        left = None if entry is None else max(0.0, entry[1].when() - asyncio.get_running_loop().time())
        return NodeView(node.node_id, node.role.value, node.state.value, info.hello.epoch if info else "",
                        node.endpoint, node.load.num_running, node.load.num_waiting, node.load.kv_usage,
                        status.num_free_blocks if status else num_blocks, num_blocks, node.inflight_requests,
                        self._server.registry.silence_s(node), left)
