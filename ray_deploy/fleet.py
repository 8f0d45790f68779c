"""RayFleet: the router's nodes as Ray actors (router/node_fleet.py), one per node.

    start()  one NodeActor per node, placed by its NodePlacement, named NAME:NODE_ID
    watch    per node: its node left (exit 0) ──▶ kill the actor for good (ActorState.LEFT)
             its actor died (its node, its process or its host) ──▶ tell the router at once (the
             node's requests move now), then wait for Ray's restart (a new epoch rejoins), or
             mark it DEAD once Ray gives up (max_restarts)
    stop()   SIGTERM to every node through its actor (each says goodbye), then kill the actors

Ray does the placing, restarting and rescheduling; the router keeps membership and moves work.
Watches run on the router's event loop and only await Ray's futures: nothing blocks it.
"""
from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from kvtransport.secret import encode_secret
from ray_deploy.config import RayConfig
from ray_deploy.node_actor import NodeActor, NodeLaunch
from ray_deploy.placement import NodePlacement, place
from ray_deploy.ray_node import ActorState, RayNode
from router.fleet_scaler import FleetScaler

if TYPE_CHECKING:
    from router.cluster.disaggregated import DisaggregatedBackend
    from router.node_processes import ClusterConfig

STOP_GRACE_S = 10.0
_UNAVAILABLE_RETRY_S = 0.5


class RayFleet:
    def __init__(self, cluster: ClusterConfig, node_flags: list[str], config: RayConfig):
        self._cluster, self._node_flags, self._config = cluster, tuple(node_flags), config
        self._tps = {"prefill": cluster.prefill_tp, "decode": cluster.decode_tp}
        self._counts = {"prefill": 0, "decode": 0}
        self._placements: dict[str, NodePlacement] = {}
        self._endpoint = ""
        self._secret: ray.ObjectRef | None = None     # the cluster secret (hex) in Ray's object store; this driver owns it
        self._backend: DisaggregatedBackend | None = None
        self.nodes: list[RayNode] = []

    # ------------------------------------------------------------ NodeFleet

    def start(self, endpoint: str, backend: DisaggregatedBackend, secret: bytes) -> None:
        # Not an actor argument: Ray keeps those in its control store (the GCS's actor table, Redis
        # when fault tolerant) for restarts. A reference to an object this driver owns is all it keeps.
        self._endpoint, self._secret, self._backend = endpoint, ray.put(encode_secret(secret)), backend
        resources = ray.cluster_resources()
        self._placements = {role: place(role, tp, resources, self._config) for role, tp in self._tps.items()}
        for role in ["prefill"] * self._cluster.prefill + ["decode"] * self._cluster.decode:
            self.add(role)
        backend.operator.scaler = FleetScaler(self, backend.server.registry, backend.operator, self._cluster)

    def starts_nodes(self) -> bool:
        return bool(self.nodes)

    async def wait_registered(self, backend: DisaggregatedBackend) -> bool:
        loop = asyncio.get_running_loop()
        deadline, shown = loop.time() + self._cluster.startup_timeout_s, -1
        while True:
            waiting = [n for n in self.nodes if n.running and backend.server.info(n.node_id) is None]
            if len(waiting) != shown:
                shown = len(waiting)
                print(f"pdserve: nodes registered: {len(self.nodes) - shown}/{len(self.nodes)}", flush=True)
            dead = [n.node_id for n in self.nodes if n.state is ActorState.DEAD]
            if dead:
                print(f"pdserve: {', '.join(dead)} could not start (their logs are above)", file=sys.stderr, flush=True)
                return False
            if not waiting:
                return True
            if loop.time() > deadline:
                needs = "; ".join(f"{role}: {p}" for role, p in self._placements.items())
                print(f"pdserve: {', '.join(n.node_id for n in waiting)} did not register within "
                      f"{self._cluster.startup_timeout_s:g} s; each node needs one host with {needs} "
                      "free (ray status shows what the cluster has)", file=sys.stderr, flush=True)
                return False
            await asyncio.sleep(0.1)

    async def supervise(self, backend: DisaggregatedBackend) -> None:
        await asyncio.Event().wait()        # the watches do the work; cancelled when serving stops

    def stop(self) -> None:
        """Called once the router's loop has ended (its watches with it)."""
        running = [n for n in self.nodes if n.running]
        refs = [n.actor.stop.remote(STOP_GRACE_S) for n in running]
        if refs:        # a node still placing or restarting does not hold up the rest past the bound
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 10)
        for node in running:
            self.retire(node)

    # ------------------------------------------------------------ what the scaler uses

    def add(self, role: str) -> RayNode:
        """A new node of `role`, with the role's next unused id (prefill-0, prefill-1, ...)."""
        node_id = f"{role}-{self._counts[role]}"
        self._counts[role] += 1
        placement = self._placements[role]
        launch = NodeLaunch(role, node_id, self._endpoint, self._node_flags, self._secret, placement.threads)
        options = placement.actor_options(f"{self._config.name}:{node_id}", self._cluster.max_restarts)
        node = RayNode(node_id, role, ray.remote(NodeActor).options(**options).remote(launch))
        node.watch = asyncio.get_running_loop().create_task(self._watch(node))
        self.nodes.append(node)
        print(f"pdserve: placing {node_id} on the Ray cluster ({placement})", file=sys.stderr, flush=True)
        return node

    def retire(self, node: RayNode) -> None:
        """Kills the node's actor for good (its node process gets SIGTERM and says goodbye)."""
        node.state = ActorState.LEFT
        ray.kill(node.actor, no_restart=True)

    def starting(self, role: str) -> list[RayNode]:
        """Running actors of `role` whose node is not registered (yet, or again after a restart)."""
        assert self._backend is not None
        return [n for n in self.nodes if n.role == role and n.running and self._backend.server.info(n.node_id) is None]

    # ------------------------------------------------------------ watches

    async def _watch(self, node: RayNode) -> None:
        while node.running:
            try:
                await node.actor.wait_exit.remote()
            except RayActorError:
                if not node.running:
                    return
                self._actor_died(node)
                if not await self._restarted(node):
                    return
                continue
            print(f"pdserve: {node.node_id} left; ending its actor", file=sys.stderr, flush=True)
            self.retire(node)

    def _actor_died(self, node: RayNode) -> None:
        print(f"pdserve: {node.node_id}'s actor died; Ray restarts it (at most {self._cluster.max_restarts} "
              "times)", file=sys.stderr, flush=True)
        assert self._backend is not None
        self._backend.server.node_exited(node.node_id, "its Ray actor died")

    async def _restarted(self, node: RayNode) -> bool:
        """Waits until Ray has the actor back (True), or has given up on it (False, DEAD)."""
        while node.running:
            try:
                incarnation = await node.actor.info.remote()
            except ActorUnavailableError:
                await asyncio.sleep(_UNAVAILABLE_RETRY_S)
                continue
            except ActorDiedError:
                if node.running:
                    node.state = ActorState.DEAD
                    print(f"pdserve: Ray gave up on {node.node_id}", file=sys.stderr, flush=True)
                return False
            node.restarts += 1
            assert self._backend is not None
            self._backend.note_restart(node.node_id)
            print(f"pdserve: {node.node_id} restarted by Ray on {incarnation.host}", file=sys.stderr, flush=True)
            return True
        return False
