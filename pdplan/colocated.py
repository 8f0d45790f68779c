"""The simulated colocated alternative: N replicas of the whole engine (prefill and decode in one
step loop, as `python -m router` runs it) behind a prefix-aware balancer.

A replica's HTTP front end is a thread of its engine's process. Pinned to one core (the
validation), the front end's CPU on a prompt takes that core from the steps as the OS shares it:
traced, a 3,403-token prompt reached the engine 8.4 ms after it was sent with the engine idle and
17.2 ms with it decoding, the steps meanwhile losing 7.7 ms (bench/validation/sim31/front_share.py).
A replica with cores to spare (a plan's hosts) pays it in time only."""
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
        # beyond a decode node's is the colocated_* overheads and, pinned, its front end's CPU
        # (ColocatedPool front_token_s); only the client floats
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
                 speed: dict[str, float] | None = None, front_token_s: float = 0.0):
        """speed: replica name -> its steps priced this many times the profile's (default 1.0).
        front_token_s: the front end's CPU per prompt token, run on the replica's core beside its steps
        (the server's own process: a step in flight is stretched by it); 0: none (it costs only time)."""
        cores, speed = cores or CoreMap(loop), speed or {}
        self.front_token_s = front_token_s
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
        add = lambda: node.engine.add(SimSeq(req, req.prompt_len, target=req.output_len))     # noqa: E731
        if self.front_token_s:
            node.engine.core.run(self.front_token_s * req.prompt_len, add, "front")
        else:
            add()

    def busy_s(self) -> float:
        return sum(n.engine.busy_s for n in self.nodes)

    def preemptions(self) -> int:
        return sum(n.engine.preemptions for n in self.nodes)
