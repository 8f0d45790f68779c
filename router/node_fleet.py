"""The nodes a deployment starts and looks after, as the launcher drives them.

`pdserve up` runs them as processes on this machine (router/node_processes.py: LocalFleet);
`pdserve ray up` as Ray actors on a Ray cluster (ray_deploy/fleet.py: RayFleet). The launcher
serves the router the same way over either:

    start(endpoint, backend) ──▶ wait_registered() ──▶ supervise() while the router serves ──▶ stop()

The fleet, not the router, places and restarts node processes; the router keeps membership
(hello, epochs, drain, goodbye) and moves a lost node's requests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.cluster.disaggregated import DisaggregatedBackend


class NodeFleet(Protocol):
    def start(self, endpoint: str, backend: DisaggregatedBackend, secret: bytes) -> None:
        """Starts the first nodes, told to join the router's control `endpoint` with `secret`
        (handed over in their environment, never argv), and sets the backend operator's
        scaler when the fleet can add nodes. Does not wait for them."""

    def starts_nodes(self) -> bool:
        """Whether the fleet started any node (a router alone waits for nodes started by hand)."""

    async def wait_registered(self, backend: DisaggregatedBackend) -> bool:
        """Until every node started has said hello; False (after saying why) if one cannot start
        or the startup timeout passes."""

    async def supervise(self, backend: DisaggregatedBackend) -> None:
        """Runs while the router serves (cancelled when it stops): tells the router at once of a
        node that died, and has it started again (bounded), so it rejoins with a new epoch."""

    def stop(self) -> None:
        """Stops every node (SIGTERM, so each says goodbye; killed after a grace period). Idempotent."""
