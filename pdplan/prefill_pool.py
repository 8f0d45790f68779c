"""The simulated prefill pool: prefill engines (max_tokens = 1) and the link each ships KV blocks on.

A request here (steps 3-5 of the lifecycle in DESIGN.md):
  1. the router picks the node that finishes it soonest: blocks booked there plus the blocks of
     this prompt it has not been sent before (sim_affinity.py, as router/cluster/policy.py)
  2. the engine prefills it in chunks beside other prompts; every block that fills is queued on
     the node's link at once (the partial last block when the prompt is done); blocks the decode
     node already holds are not sent; the link sends one block at a time, per_block_s each
  3. the step that completes the prompt samples the first token: the router has it at once
  4. Commit follows the last block on the link (+ per_transfer_s): the decode node adopts
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdplan.events import EventLoop
from pdplan.profile import Profile
from pdplan.sim_affinity import PrefixAffinity
from pdplan.sim_core import CoreMap, SimCore
from pdplan.sim_engine import SimEngine, SimSeq
from pdplan.sim_request import SimRequest


@dataclass(slots=True)
class _Shipment:
    skip: int                       # leading blocks the decode node holds already
    sent: int                       # blocks queued on the link so far
    on_first_token: Callable[[float], None]
    on_commit: Callable[[float], None]


class PrefillNode:
    def __init__(self, name: str, profile: Profile, loop: EventLoop, core: SimCore | None = None):
        self.engine = SimEngine(name, profile, loop, self, False, core=core)
        self.profile, self.loop = profile, loop
        self.link_free_at = 0.0
        self.shipments: dict[int, _Shipment] = {}

    def submit(self, req: SimRequest, skip: int, on_first_token, on_commit) -> None:
        self.shipments[req.rid] = _Shipment(skip, skip, on_first_token, on_commit)
        self.engine.add(SimSeq(req, req.prompt_len, target=1))

    def computed(self, seq: SimSeq, before: int, t: float) -> None:
        ship = self.shipments[seq.req.rid]
        done = seq.computed == seq.req.prompt_len
        ready = self.profile.blocks(seq.computed) if done else seq.computed // self.profile.block_size
        per_block = self.profile.transfer.per_block_s
        while ship.sent < ready:
            self.link_free_at = max(self.link_free_at, t) + per_block
            ship.sent += 1

    def sampled(self, seq: SimSeq, t: float) -> None:
        ship = self.shipments.pop(seq.req.rid)
        ship.on_first_token(t)
        commit = max(self.link_free_at, t) + self.profile.transfer.per_transfer_s
        self.loop.at(commit, lambda: ship.on_commit(commit))

    def finished(self, seq: SimSeq, t: float) -> None:
        pass


class PrefillPool:
    def __init__(self, count: int, profile: Profile, loop: EventLoop, cores: CoreMap | None = None,
                 speed: dict[str, float] | None = None):
        """speed: node name -> its steps priced this many times the profile's (default 1.0)."""
        cores, speed = cores or CoreMap(loop), speed or {}
        self.nodes = [PrefillNode(name, profile.at_speed(speed.get(name, 1.0)), loop, cores.of(name))
                      for name in (f"prefill-{i}" for i in range(count))]
        self.affinity = PrefixAffinity(count, lambda i: self.nodes[i].engine.load())
        self.profile = profile

    def submit(self, req: SimRequest, skip: int, on_first_token: Callable[[float], None],
               on_commit: Callable[[float], None]) -> PrefillNode:
        """To the node the router would choose; its booking ends with the first token."""
        i, new_blocks = self.affinity.choose(req.block_hashes, self.profile.blocks(req.prompt_len))

        def first_token(t: float) -> None:
            self.affinity.release(i, new_blocks)
            on_first_token(t)
        self.nodes[i].submit(req, skip, first_token, on_commit)
        return self.nodes[i]

    def busy_s(self) -> float:
        return sum(n.engine.busy_s for n in self.nodes)
