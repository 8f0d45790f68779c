"""The simulated colocated alternative: N replicas of the whole engine (prefill and decode in one
step loop, as `python -m router` runs it) behind a prefix-aware balancer."""
from __future__ import annotations

from pdplan.events import EventLoop
from pdplan.profile import Profile
from pdplan.sim_core import CoreMap, SimCore
from pdplan.sim_engine import SimEngine, SimSeq
from pdplan.sim_request import SimRequest


class ColocatedNode:
    def __init__(self, name: str, profile: Profile, loop: EventLoop, core: SimCore | None = None):
        self.engine = SimEngine(name, profile, loop, self, True, profile.overheads.token_s, core)

    def computed(self, seq: SimSeq, before: int, t: float) -> None:
        pass

    def sampled(self, seq: SimSeq, t: float) -> None:
        pass                            # streamed by the engine

    def finished(self, seq: SimSeq, t: float) -> None:
        pass


class ColocatedPool:
    def __init__(self, count: int, profile: Profile, loop: EventLoop, cores: CoreMap | None = None):
        cores = cores or CoreMap(loop)
        self.nodes = [ColocatedNode(f"colocated-{i}", profile, loop, cores.of(f"colocated-{i}")) for i in range(count)]

    def submit(self, req: SimRequest) -> None:
        """To the replica that finishes the prompt soonest: its queued prompt tokens plus this
        prompt's tokens it has not cached (the prefill pool's rule, so both see the same hits),
        then the fewest sequences."""
        bs = self.nodes[0].engine.bs

        def cost(n: ColocatedNode) -> tuple[int, int]:
            uncached = req.prompt_len - n.engine.pool.hits(req.block_hashes) * bs
            return n.engine.queued_tokens() + uncached, n.engine.num_seqs() + len(n.engine.waiting)
        min(self.nodes, key=cost).engine.add(SimSeq(req, req.prompt_len, target=req.output_len))

    def busy_s(self) -> float:
        return sum(n.engine.busy_s for n in self.nodes)

    def preemptions(self) -> int:
        return sum(n.engine.preemptions for n in self.nodes)
