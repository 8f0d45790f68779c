"""The driver's record of one node actor, from its start until it leaves or Ray gives up on it.

    STARTING ──hello──▶ (registered: the router's registry has it; still RUNNING here)
    RUNNING ──its node exits 0 (drained, removed)──▶ LEFT: its actor is killed for good
    RUNNING ──its actor dies──▶ RUNNING again once Ray restarted it (restarts + 1), or DEAD when
                               max_restarts are spent
    STARTING / RUNNING ──retired (a scale-down of a node not yet registered, or stop)──▶ LEFT
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import Any


class ActorState(Enum):
    RUNNING = "running"     # started (it may still be placing or registering), or restarted
    LEFT = "left"           # its node left on purpose, or it was retired; its actor is gone
    DEAD = "dead"           # Ray gave up restarting it


@dataclass(slots=True)
class RayNode:
    node_id: str
    role: str                           # "prefill" | "decode"
    actor: Any                          # the NodeActor handle
    state: ActorState = ActorState.RUNNING
    restarts: int = 0                   # restarts by Ray seen so far
    watch: asyncio.Task | None = None   # the fleet's watch on the actor

    @property
    def running(self) -> bool:
        return self.state is ActorState.RUNNING
