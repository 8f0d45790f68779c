"""The router's end of the control plane: one ZMQ ROUTER socket, node membership and liveness.

    node DEALER ──[routing id, header, trailer]──▶ ROUTER socket (here)
                ◀──[routing id, header, trailer]──

0. a connection first passes ZMTP PLAIN (kvtransport.zmtp_auth: a password derived from the
   cluster secret), else none of its frames is read (counted as "zmtp_refused"); then it proves
   that it holds the secret (kvtransport.session); until it does, its frames are dropped unread
   (answered RESET if they look sealed) and counted. Sessions are the connection's own
   (zmtp_auth.connection_name): one that takes a closed connection's routing id has none
1. every sealed frame is authenticated, then decoded with pdwire.control; a malformed
   frame, a router-to-node kind, or a message from a connection that has not said hello is
   dropped and counted, never raised
2. NodeHello binds the connection to the node id it names and registers the node ("ok"); a
   hello with a new epoch for a known node id is a restarted node, whatever connection it
   comes on: the old one is lost first (its requests fail over)
3. NodeStatus is the heartbeat: answered "ok", "register" (unknown node or stale epoch) or
   "leave" (drained and idle); NodeGoodbye (a clean exit) loses the node at once; KVEvents of
   the registered node's current epoch go to the listener (the router's KV index)
   A node told to leave (drained, removed) is answered "leave" until it says goodbye, so it
   cannot register again in the same epoch
4. request messages (Reserved, Busy, FirstToken, TokenDelta, RequestFailed, Paused) go to the listener
5. a node silent for heartbeat_timeout_s is removed and the listener told that it is lost
   (every loss carries a router.cluster.membership.LossCause, counted in `membership`)

Everything runs on the event loop that called start(); nothing here blocks.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio
from prometheus_client import Counter

from pdwire import control
from pdwire.control import (FirstToken, GrammarReady, KVEvents, NodeCommand, NodeGoodbye, NodeHello,
                            NodeStatus, Paused, RequestFailed, TokenDelta)
from kvtransport.framing import FrameError, control_framer
from pdwire.figures import PrefixCounters
from pdwire.kv_endpoint import kv_endpoint_problem
from pdwire.messages import Busy, Reserved
from kvtransport.metrics import DropReason
from kvtransport.session import AuthError, AuthKind, Responder, parse_auth_frame
from kvtransport.zmtp_auth import ThreadGuard, connection_name, routing_id
from router.backend import NodeMetrics
from router.cluster.membership import LossCause, MembershipMetrics, NodeLoss
from router.cluster.registry import HeartbeatReply, NodeLoad, NodeRegistry, NodeRole, NodeState

log = logging.getLogger(__name__)

REQUEST_MESSAGES = (Reserved, Busy, FirstToken, TokenDelta, RequestFailed, Paused, GrammarReady)
_SEND_HWM = 10_000      # queued messages per node before the socket drops (a wedged node)
_RECV_HWM = 10_000      # queued messages from one connection before the socket stops reading it
_CLOSE_LINGER_MS = 200
_YIELD_EVERY = 64       # messages handled before the receive loop lets other tasks run


class ControlListener(Protocol):
    def on_request_message(self, node_id: str, msg: Any) -> bool:
        """A request message from a registered node; False if nobody waits for it (dropped)."""

    def on_node_lost(self, node_id: str, loss: NodeLoss) -> None:
        """The node died, restarted or left: whatever it was doing will not finish."""

    def on_kv_events(self, node_id: str, msg: KVEvents) -> None:
        """What the registered node's prefix cache stored and evicted (this epoch)."""


@dataclass(slots=True)
class NodeInfo:
    hello: NodeHello                  # what the node said when it registered (this epoch)
    peer: str                         # the connection it registered on (zmtp_auth.connection_name)
    status: NodeStatus | None = None  # its latest heartbeat


class ControlServer:
    def __init__(self, registry: NodeRegistry, listener: ControlListener, secret: bytes,
                 bind: str = "tcp://127.0.0.1:0", expire_interval_s: float = 0.25):
        self.registry = registry
        self._auth = Responder(secret)
        self._secret = secret
        self._framer = control_framer()
        self._node_of: dict[str, str] = {}       # connection -> the node id its session said hello as
        self._listener = listener
        self._bind = bind
        self._expire_interval_s = expire_interval_s
        self._nodes: dict[str, NodeInfo] = {}
        self._leaving: dict[str, NodeInfo] = {}  # told to leave, no goodbye yet: by node id
        self._idle_loss: dict[str, NodeLoss] = {}  # a draining node's loss if it leaves at an idle heartbeat
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._guard: ThreadGuard | None = None   # ZAP handler of the socket's ZMTP PLAIN
        self._tasks: list[asyncio.Task] = []
        self._drops: dict[str, int] = {}      # per reason, to keep a flood of garbage out of the log
        self.endpoint: str | None = None      # the bound address, once started
        self.dropped = Counter("pdserve_router_dropped_control_frames",
                               "Control frames the router dropped, by reason.", ["reason"], registry=None)
        self.membership = MembershipMetrics(registry.nodes)

    async def start(self) -> str:
        """Binds the socket and starts serving on the running loop; returns the endpoint. Idempotent."""
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            # The ZAP handler runs on a thread of its own (pyzmq's asyncio one stops answering once
            # a second one has run on a loop); its refusals are counted here, by _expire_loop.
            self._guard = ThreadGuard(self._ctx, self._secret)
            self._guard.start()
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._guard.protect(self._sock, _RECV_HWM)
            self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
            self._sock.setsockopt(zmq.MAXMSGSIZE, control.MAX_CONTROL_BYTES)   # bigger: disconnected
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(self._bind)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks = [asyncio.create_task(self._receive_loop(), name="pdserve-control-recv"),
                           asyncio.create_task(self._expire_loop(), name="pdserve-control-expire")]
        return self.endpoint

    def close(self) -> None:
        """Stops serving and closes the socket; idempotent."""
        for task in self._tasks:
            if not task.done() and not task.get_loop().is_closed():
                task.cancel()
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=_CLOSE_LINGER_MS)    # lets the last AbortRequests go out
            self._guard.stop()
            self._ctx.term()
            self._sock = self._ctx = self._guard = None

    def send(self, node_id: str, msg: Any) -> None:
        """Queues msg for the node; a node that is gone never gets it. Raises ProtocolError for a
        message above the control plane's size limit (a node could not read it)."""
        info = self._nodes.get(node_id)
        if self._sock is None or info is None:
            return
        self._send_to(info.peer, msg)

    def _send_to(self, peer: str, msg: Any) -> None:
        session = self._auth.session(peer)
        if session is not None:
            sent = self._sock.send_multipart([routing_id(peer), *self._framer.pack(session, msg)])
            sent.add_done_callback(_log_send_failure)

    def drain(self, node_id: str, idle_loss: NodeLoss | None = None) -> None:
        """No new work for the node; it is told to leave at its first idle heartbeat, and lost
        then as `idle_loss` (a take-out under way: its cause), else as drained. KeyError if unknown."""
        node = self.registry.get(node_id)
        draining = node is not None and node.state is NodeState.DRAINING
        self.registry.drain(node_id)
        if idle_loss is not None:
            self._idle_loss[node_id] = idle_loss
        if not draining:
            self.send(node_id, NodeCommand("drain"))

    def remove(self, node_id: str, loss: NodeLoss) -> None:
        """Tells the node to leave and loses it now (its requests move). KeyError if unknown."""
        info = self._nodes.get(node_id)
        if info is None:
            raise KeyError(f"unknown node {node_id!r}")
        self._send_to(info.peer, NodeCommand("leave"))
        self._leaving[node_id] = info
        self._lose(node_id, loss)

    # ------------------------------------------------------------ what the backend reads

    def info(self, node_id: str) -> NodeInfo | None:
        return self._nodes.get(node_id)

    @property
    def block_size(self) -> int | None:
        """The nodes' KV block size (they must agree); None before any node registered."""
        return next((i.hello.block_size for i in self._nodes.values()), None)

    @property
    def max_model_len(self) -> int | None:
        """The smallest context of the registered nodes; None before any registered."""
        return min((i.hello.max_model_len for i in self._nodes.values()), default=None)

    def count(self, role: NodeRole) -> int:
        """Live nodes of `role` that take new work."""
        return len(self.registry.candidates(role))

    def node_metrics(self) -> list[NodeMetrics]:
        out = []
        for node in self.registry.nodes():
            info = self._nodes.get(node.node_id)
            s = info.status if info is not None else None
            out.append(NodeMetrics(node.node_id, node.role.value, node.load.num_running,
                                   node.load.num_waiting, node.load.kv_usage,
                                   s.prefix_hit_rate if s else 0.0, s.num_preemptions if s else 0,
                                   s.transfer if s else (), s.prefix if s else PrefixCounters(),
                                   info.hello.block_size if info else 0, info.hello.num_blocks if info else 0))
        return out

    # ------------------------------------------------------------ loops

    async def _receive_loop(self) -> None:
        handled = 0
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                self._handle(connection_name(frames[0]), [f.buffer for f in frames[1:]])
            except Exception:   # noqa: BLE001 -- one bad message must not stop the control plane
                log.exception("control message handling failed")
                self.dropped.labels("error").inc()
            handled += 1
            if handled % _YIELD_EVERY == 0:    # a queued message is a finished await: let HTTP run
                await asyncio.sleep(0)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self._expire_interval_s)
            for address in self._guard.take_refused():
                self._drop("zmtp_refused", f"ZMTP handshake from {address} refused")
            for node_id in self.registry.expire():
                self._lose(node_id, NodeLoss(LossCause.HEARTBEAT))

    # ------------------------------------------------------------ one frame

    def _handle(self, peer: str, frames: list[memoryview]) -> None:
        """One message [header, trailer] (or a handshake frame) from the connection peer."""
        auth = parse_auth_frame(frames)
        if auth is not None:
            if auth[0] is not AuthKind.HELLO:
                return self._drop("unexpected", f"auth {auth[0].name}")
            challenge = self._auth.challenge(peer, auth[1])
            return None if challenge is None else self._reply_raw(peer, challenge)
        try:
            self._framer.check_sizes(frames)
            _, opened = self._auth.open(peer, frames)
            msg = self._framer.decode(opened).msg
        except AuthError as err:
            if err.reason is DropReason.NOT_AUTHENTICATED and (reset := self._auth.refuse(peer)):
                self._reply_raw(peer, reset)
            return self._drop(err.reason.value, err.detail)
        except FrameError as err:
            return self._drop(err.reason.value, err.detail)
        if isinstance(msg, NodeHello):
            return self._on_hello(peer, msg)
        node_id = self._node_of.get(peer)
        if isinstance(msg, NodeStatus):
            return self._on_status(peer, node_id, msg)
        if isinstance(msg, NodeGoodbye):
            return self._on_goodbye(peer, node_id, msg)
        if isinstance(msg, KVEvents):
            return self._on_kv_events(peer, node_id, msg)
        if not isinstance(msg, REQUEST_MESSAGES):
            return self._drop("unexpected", f"{type(msg).__name__} from {node_id!r}")
        if node_id is None or node_id not in self._nodes:
            return self._drop("unknown_node", f"{type(msg).__name__} before a hello")
        if not self._listener.on_request_message(node_id, msg):
            self.dropped.labels("stray").inc()

    def _reply_raw(self, peer: str, frame: bytes) -> None:
        """A handshake frame (no session needed); never blocks (ROUTER drops at the HWM)."""
        self._sock.send_multipart([routing_id(peer), frame]).add_done_callback(_log_send_failure)

    def _on_hello(self, peer: str, hello: NodeHello) -> None:
        node_id = hello.node_id
        if self._node_of.get(peer, node_id) != node_id:
            return self._drop("unexpected", f"a session of {self._node_of[peer]!r} said hello as {node_id!r}")
        if self._still_leaving(node_id, hello.epoch):
            return self._send_to(peer, NodeCommand("leave"))
        known = self._nodes.get(node_id)
        if known is not None and known.peer != peer:     # its old connection is done with
            self._auth.forget(known.peer)
        if known is not None and known.hello.epoch != hello.epoch:
            self._lose(node_id, NodeLoss(LossCause.RESTARTED))
            known = None
        if known is not None and known.hello.role != hello.role:
            return self._drop("unexpected", f"{node_id!r} changed role within epoch {hello.epoch}")
        if known is not None and known.peer != peer:
            self._node_of.pop(known.peer, None)          # the same epoch on a new connection
        if hello.role == NodeRole.DECODE.value and (problem := kv_endpoint_problem(hello.kv_endpoint)):
            self.dropped.labels("incompatible").inc()
            log.error("decode node %s announces no usable kv_endpoint (%s): told to leave", node_id, problem)
            return self._send_to(peer, NodeCommand("leave"))
        others = {i.hello.block_size for n, i in self._nodes.items() if n != node_id}
        if others and hello.block_size not in others:
            log.error("node %s uses block size %d, the others %s: told to leave", node_id,
                      hello.block_size, sorted(others))
            self.dropped.labels("incompatible").inc()
            return self._send_to(peer, NodeCommand("leave"))
        self.registry.register(node_id, NodeRole(hello.role), hello.kv_endpoint)
        self._nodes[node_id] = NodeInfo(hello, peer)
        self._node_of[peer] = node_id
        if known is None:
            self.membership.joins.inc()
            log.info("%s node %s registered (epoch %s, %d blocks of %d)", hello.role, node_id,
                     hello.epoch, hello.num_blocks, hello.block_size)
        self.send(node_id, NodeCommand("ok"))

    def _on_status(self, peer: str, node_id: str | None, status: NodeStatus) -> None:
        if status.node_id != node_id:
            if node_id is not None:
                return self._drop("unexpected", f"status from {node_id!r} names {status.node_id!r}")
            left = self._leaving.get(status.node_id)
            told = left is not None and left.peer == peer and left.hello.epoch == status.epoch
            return self._send_to(peer, NodeCommand("leave" if told else "register"))
        info = self._nodes.get(node_id)
        if info is None or info.hello.epoch != status.epoch or info.peer != peer:
            return self._send_to(peer, NodeCommand("register"))
        reply = self.registry.heartbeat(node_id, NodeLoad(status.num_running, status.num_waiting,
                                                          status.kv_usage))
        info.status = status
        if reply is HeartbeatReply.LEAVE:     # drained and idle: the registry let it go
            self._leaving[node_id] = info
        if reply is not HeartbeatReply.OK:
            idle_loss = self._idle_loss.get(node_id) or NodeLoss(LossCause.DRAINED, "idle")
            loss = idle_loss if reply is HeartbeatReply.LEAVE else NodeLoss(LossCause.HEARTBEAT)
            self._forget(node_id)
            self.membership.losses.labels(loss.cause.value).inc()
            self._listener.on_node_lost(node_id, loss)
        self._send_to(peer, NodeCommand({HeartbeatReply.OK: "ok", HeartbeatReply.LEAVE: "leave",
                                        HeartbeatReply.UNKNOWN: "register"}[reply]))

    def _on_kv_events(self, peer: str, node_id: str | None, msg: KVEvents) -> None:
        info = self._nodes.get(msg.node_id)
        if node_id != msg.node_id or info is None or info.peer != peer or info.hello.epoch != msg.epoch:
            return self._drop("unexpected", f"KV events from {node_id!r} name {msg.node_id!r}/{msg.epoch}")
        self._listener.on_kv_events(node_id, msg)

    def _on_goodbye(self, peer: str, node_id: str | None, bye: NodeGoodbye) -> None:
        left = self._leaving.get(bye.node_id)
        if left is not None and left.peer == peer and left.hello.epoch == bye.epoch:
            del self._leaving[bye.node_id]       # told to leave, and gone: lost already
            self.membership.goodbyes.inc()
            return self._auth.forget(peer)
        info = self._nodes.get(bye.node_id)
        if node_id != bye.node_id or info is None or info.hello.epoch != bye.epoch:
            return self._drop("unexpected", f"goodbye from {node_id!r} names {bye.node_id!r}/{bye.epoch}")
        self.membership.goodbyes.inc()
        self._lose(bye.node_id, NodeLoss(LossCause.GOODBYE, bye.reason))
        self._auth.forget(peer)

    def node_exited(self, node_id: str, detail: str) -> None:
        """A process supervisor saw the node's process end: its work is lost now, not after the
        heartbeat timeout (the launcher calls this for the nodes it started)."""
        self._leaving.pop(node_id, None)
        self._lose(node_id, NodeLoss(LossCause.EXITED, detail))

    def _still_leaving(self, node_id: str, epoch: str) -> bool:
        """Whether this epoch of the node was told to leave; a new epoch forgets that."""
        left = self._leaving.get(node_id)
        if left is not None and left.hello.epoch != epoch:
            del self._leaving[node_id]
        return node_id in self._leaving

    def _lose(self, node_id: str, loss: NodeLoss) -> None:
        self.registry.remove(node_id)
        if self._forget(node_id) is not None:
            log.warning("node %s lost: %s", node_id, loss)
            self.membership.losses.labels(loss.cause.value).inc()
            self._listener.on_node_lost(node_id, loss)

    def _forget(self, node_id: str) -> NodeInfo | None:
        """Unbinds the node from its connection; its session stays (it may say hello again)."""
        info = self._nodes.pop(node_id, None)
        self._idle_loss.pop(node_id, None)
        if info is not None and self._node_of.get(info.peer) == node_id:
            del self._node_of[info.peer]
        return info

    def _drop(self, reason: str, detail: str) -> None:
        n = self._drops[reason] = self._drops.get(reason, 0) + 1
        if n & (n - 1) == 0:    # the 1st, 2nd, 4th, 8th ... of a kind
            log.warning("dropped a control frame (%s, %d so far): %s", reason, n, detail)
        self.dropped.labels(reason).inc()


def _log_send_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("control send failed: %r", sent.exception())

