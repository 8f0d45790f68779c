"""The simulated decode pool: decode engines that reserve blocks for a prompt (or answer Busy),
adopt the shipped blocks on Commit, and decode in continuous batches, preempting by recompute
when their blocks run out (a recomputed sequence is prefilled again on the decode node)."""
from __future__ import annotations

import math
import random
from typing import Callable

from pdplan.events import EventLoop
from pdplan.load_view import HEARTBEAT_S, LoadView
from pdplan.profile import Profile
from pdplan.sim_core import CoreMap, FloatingWork, SimCore
from pdplan.sim_engine import LoopCost, SimEngine, SimSeq
from pdplan.sim_request import SimRequest
from router.cluster.routing_cost import BALANCE, imbalanced
from router.config import LOCAL_PREFILL_TOKENS


class DecodeNode:
    def __init__(self, name: str, profile: Profile, loop: EventLoop, on_room: Callable[[], None],
                 core: SimCore | None = None, floating: FloatingWork | None = None, phase: float = 0.0):
        o = profile.overheads      # the router and the client float: neither runs on this node's core
        self.engine = SimEngine(name, profile, loop, self, True, LoopCost(per_sample_s=o.token_s), core, floating,
                                o.router_token_s + o.client_token_s)
        self.view = LoadView(self.engine, loop, phase)     # the router's view of it: heartbeats + bookings
        self.on_room = on_room

    def computed(self, seq: SimSeq, before: int, t: float) -> None:
        pass

    def sampled(self, seq: SimSeq, t: float) -> None:
        pass                            # streamed by the engine

    def finished(self, seq: SimSeq, t: float) -> None:
        self.view.release(seq.req.rid)
        self.on_room()

    def free_fraction(self) -> float:
        return self.engine.pool.available / self.engine.pool.total


class DecodePool:
    def __init__(self, count: int, profile: Profile, loop: EventLoop, on_room: Callable[[], None],
                 cores: CoreMap | None = None, seed: int = 0, ranked_before: int = 0,
                 local_prefill_tokens: int = LOCAL_PREFILL_TOKENS, speed: dict[str, float] | None = None):
        """ranked_before: requests the router ranked before these (a measured run's warm-up and
        earlier points): its coin drew once per node for each, so this one starts where it stood.
        local_prefill_tokens: the router's (sim_router.py's): a prompt with at most this many
        tokens uncached on its node is booked there as queued prefill work too.
        speed: node name -> its steps priced this many times the profile's (default 1.0)."""
        cores, speed = cores or CoreMap(loop), speed or {}
        self.local_prefill_tokens = local_prefill_tokens
        self._rng = random.Random(seed)     # ties go to a seeded coin, as the router's (RoutingCost)
        for _ in range(ranked_before * count):
            self._rng.random()
        self.loop, self.on_room = loop, on_room
        # request -> node -> the free blocks of the node's last heartbeat when it said Busy to it
        self._refused: dict[int, dict[str, int]] = {}
        self._wakes: set[float] = set()                 # heartbeat times a waiting request is woken at
        phases = random.Random(seed)        # each node's heartbeats fall at a phase of its own
        self.nodes = [DecodeNode(name, profile.at_speed(speed.get(name, 1.0)), loop, on_room, cores.of(name),
                                 cores.floating, phases.uniform(0, HEARTBEAT_S))
                      for name in (f"decode-{i}" for i in range(count))]

    def reserve(self, req: SimRequest, probe: bool = False) -> tuple[DecodeNode, int] | None:
        """Asks decode nodes in turn as router/cluster/admission.py does, and returns the one that
        reserved the prompt's blocks (with the leading blocks it held), or None: the router waits
        for a heartbeat, a request's end or its timer (sim_router.py).

        Each ask ranks the nodes anew (_rank: the router's cost, its coin drawn each time) and takes
        the first one the router's view (load_view.py) shows room on: its last heartbeat's free
        blocks less the bookings since, against the prompt and its growth (admission.py
        _need_blocks; policy.py has_room), skipping a node that said Busy to this request until its
        heartbeat shows more free blocks; with none, the first ranked one if `probe` (the router's
        timer fired), else none. The node then checks its own state (SimEngine.reserve): Busy puts
        it on the request's refused list and the router asks again."""
        blocks = self.nodes[0].engine.profile.blocks(req.prompt_len)
        for node in self._asks(req, probe):
            seq = SimSeq(req, req.prompt_len, target=req.output_len)
            got = node.engine.reserve(seq, req.output_len)
            if got is not None:
                local = req.prompt_len - got.hits * node.engine.bs <= self.local_prefill_tokens
                node.view.book(req.rid, got.taken, blocks - got.hits if local else 0)     # admission.py _taken
                req.decode_node = node.engine.name
                self._refused.pop(req.rid, None)
                return node, got.hits
            self._refused.setdefault(req.rid, {})[node.engine.name] = self._beat_free(node)    # Busy
        self._wake_at_heartbeats()
        return None

    def _asks(self, req: SimRequest, probe: bool):
        """The nodes the router asks for one request, in turn: one ranking per ask; the node
        req.replay_decode names, once, room or not."""
        need = self.nodes[0].engine.profile.blocks(req.prompt_len + req.output_len)
        refused = self._refused.get(req.rid, {})
        while True:
            ranked = self._rank(req)
            if req.replay_decode:
                yield from [n for n in ranked if n.engine.name == req.replay_decode][:1]
                return
            fit = [n for n in ranked if self._beat_free(n) > refused.get(n.engine.name, -1) and self._room(n, need)]
            if not fit and not probe:
                return
            yield fit[0] if fit else ranked[0]
            probe, refused = False, self._refused.get(req.rid, {})

    def _rank(self, req: SimRequest) -> list[DecodeNode]:
        """The router's ranking (router/cluster/routing_cost.py, its default: no waiting requests
        first, then the prompt blocks a node lacks plus its queued local prefills' plus its blocks in
        use (_cost), ties by a seeded coin, not by node order; by sequences first when the load
        guard holds; load as the router knows it, load_view.py)."""
        blocks = self.nodes[0].engine.profile.blocks(req.prompt_len)
        usable = req.block_hashes[:(req.prompt_len - 1) // self.nodes[0].engine.bs]
        guard = imbalanced([n.view.sequences for n in self.nodes], BALANCE)
        # drawn even when replayed (the coin keeps step), in the router's order: its registry lists
        # nodes by id as text, so decode-10 draws before decode-2
        coin = {id(n): self._rng.random() for n in sorted(self.nodes, key=lambda n: n.engine.name)}
        return sorted(self.nodes, key=lambda n: (n.view.sequences if guard else 0, n.view.beat_waiting,
                                                 _cost(n, blocks, usable), coin[id(n)]))

    @staticmethod
    def _beat_free(node: DecodeNode) -> int:
        """The node's free blocks by its last heartbeat (a Busy node is skipped until they grow)."""
        return node.engine.pool.total - node.view.beat_used

    @staticmethod
    def _room(node: DecodeNode, need: int) -> bool:
        """Room for `need` blocks by the router's view, or never any (the node then refuses)."""
        return need > node.engine.pool.total or node.engine.pool.total - node.view.used_blocks >= need

    def _wake_at_heartbeats(self) -> None:
        """A request waits: the router tries again at each decode node's next heartbeat
        (admission.py CapacityWatch), after the view has taken it in (scheduled later, it runs
        after the heartbeat of the same instant)."""
        for node in self.nodes:
            view, now = node.view, self.loop.now
            t = view.phase + (math.floor((now - view.phase) / view.period) + 1) * view.period
            if t <= now:                # now is a heartbeat's instant, rounded below it: the one after
                t += view.period
            if t not in self._wakes:
                self._wakes.add(t)
                self.loop.at(t, lambda t=t: (self._wakes.discard(t), self.on_room()))

    def busy_s(self) -> float:
        return sum(n.engine.busy_s for n in self.nodes)

    def preemptions(self) -> int:
        return sum(n.engine.preemptions for n in self.nodes)


def _cost(node: DecodeNode, blocks: int, usable: tuple[int, ...]) -> int:
    """routing_cost.py cost(D): uncached(D) + queued(D) + used(D) + uncached(D) (decode_load_weight 1)."""
    uncached = blocks - node.engine.pool.hits(usable)
    return uncached + node.view.queued_blocks + node.view.used_blocks + uncached
