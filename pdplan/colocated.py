"""The simulated colocated alternative: N replicas of the whole engine (prefill and decode in one
step loop, as `python -m router` runs it) behind a prefix-aware balancer."""
from __future__ import annotations

from typing import Callable

from pdplan.events import EventLoop
from pdplan.profile import Profile
from pdplan.sim_affinity import PrefixAffinity
from pdplan.sim_core import CoreMap, FloatingWork, SimCore
from pdplan.sim_engine import LoopCost, SimEngine, SimSeq
from pdplan.sim_request import SimRequest


class ColocatedNode:
    def __init__(self, name: str, profile: Profile, loop: EventLoop, core: SimCore | None = None,
                 floating: FloatingWork | None = None):
        # the router is the engine's own process (its core, its GIL): what it costs the engine's loop
        # beyond a decode node's is the colocated_* overheads; only the client floats
        o = profile.overheads
        self.engine = SimEngine(name, profile, loop, self, True,
                                LoopCost(o.colocated_step_s, o.token_s, o.colocated_admit_s, o.colocated_admit_token_s),
                                core, floating, o.client_token_s)
        self.on_first_token: dict[int, Callable[[], None]] = {}

    def computed(self, seq: SimSeq, before: int, t: float) -> None:
        if seq.computed == seq.length and seq.generated == 0:
            self.on_first_token.pop(seq.req.rid, lambda: None)()

    def sampled(self, seq: SimSeq, t: float) -> None:
        pass                            # streamed by the engine

    def finished(self, seq: SimSeq, t: float) -> None:
        pass


class ColocatedPool:
    def __init__(self, count: int, profile: Profile, loop: EventLoop, cores: CoreMap | None = None,
                 speed: dict[str, float] | None = None):
        """speed: replica name -> its steps priced this many times the profile's (default 1.0)."""
        cores, speed = cores or CoreMap(loop), speed or {}
        self.nodes = [ColocatedNode(name, profile.at_speed(speed.get(name, 1.0)), loop, cores.of(name), cores.floating)
                      for name in (f"colocated-{i}" for i in range(count))]
        self.affinity = PrefixAffinity(count, lambda i: self.nodes[i].engine.load(), balance=True)
        self.profile = profile

    def submit(self, req: SimRequest) -> None:
        """To the replica that finishes the prompt soonest, by the prefill pool's rule (blocks
        booked there plus this prompt's blocks not sent there before: sim_affinity.py), so both
        see the same hits, unless the replicas' loads are far apart (then the idlest); the
        booking ends with the prompt's last chunk."""
        i, new_blocks = self.affinity.choose(req.block_hashes, self.profile.blocks(req.prompt_len))
        node = self.nodes[i]
        node.on_first_token[req.rid] = lambda: self.affinity.release(i, new_blocks)
        node.engine.add(SimSeq(req, req.prompt_len, target=req.output_len))

    def busy_s(self) -> float:
        return sum(n.engine.busy_s for n in self.nodes)

    def preemptions(self) -> int:
        return sum(n.engine.preemptions for n in self.nodes)
