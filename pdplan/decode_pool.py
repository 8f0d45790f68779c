"""The simulated decode pool: decode engines that reserve blocks for a prompt (or answer Busy),
adopt the shipped blocks on Commit, and decode in continuous batches, preempting by recompute
when their blocks run out (a recomputed sequence is prefilled again on the decode node)."""
from __future__ import annotations

import random
from typing import Callable

from pdplan.events import EventLoop
from pdplan.load_view import HEARTBEAT_S, LoadView
from pdplan.profile import Profile
from pdplan.sim_core import CoreMap, FloatingWork, SimCore
from pdplan.sim_engine import SimEngine, SimSeq
from pdplan.sim_request import SimRequest
from router.cluster.routing_cost import BALANCE, imbalanced


class DecodeNode:
    def __init__(self, name: str, profile: Profile, loop: EventLoop, on_room: Callable[[], None],
                 core: SimCore | None = None, floating: FloatingWork | None = None, phase: float = 0.0):
        o = profile.overheads      # the router and the client float: neither runs on this node's core
        self.engine = SimEngine(name, profile, loop, self, True, o.token_s, core, floating,
                                o.router_token_s + o.client_token_s)
        self.view = LoadView(self.engine, loop, phase)     # the router's view of it: heartbeats + bookings
        self.on_room = on_room

    def computed(self, seq: SimSeq, before: int, t: float) -> None:
        pass

    def sampled(self, seq: SimSeq, t: float) -> None:
        pass                            # streamed by the engine

    def finished(self, seq: SimSeq, t: float) -> None:
        self.view.release(self.engine.profile.blocks(seq.req.prompt_len))
        self.on_room()

    def free_fraction(self) -> float:
        return self.engine.pool.available / self.engine.pool.total


class DecodePool:
    def __init__(self, count: int, profile: Profile, loop: EventLoop, on_room: Callable[[], None],
                 cores: CoreMap | None = None, seed: int = 0, ranked_before: int = 0):
        """ranked_before: requests the router ranked before these (a measured run's warm-up and
        earlier points): its coin drew once per node for each, so this one starts where it stood."""
        cores = cores or CoreMap(loop)
        self._rng = random.Random(seed)     # ties go to a seeded coin, as the router's (RoutingCost)
        for _ in range(ranked_before * count):
            self._rng.random()
        phases = random.Random(seed)        # each node's heartbeats fall at a phase of its own
        self.nodes = [DecodeNode(f"decode-{i}", profile, loop, on_room, cores.of(f"decode-{i}"), cores.floating,
                                 phases.uniform(0, HEARTBEAT_S)) for i in range(count)]

    def reserve(self, req: SimRequest) -> tuple[DecodeNode, int] | None:
        """The cheapest node with room reserves the prompt's blocks (router/cluster/routing_cost.py,
        the router's default: no waiting requests first, then the prompt blocks it lacks plus its
        blocks in use, ties by a seeded coin, not by node order; by sequences first when the load
        guard holds; load as the router knows it, load_view.py), or the node req.replay_decode
        names; None when none has room (the router waits for some)."""
        blocks = self.nodes[0].engine.profile.blocks(req.prompt_len)
        usable = req.block_hashes[:(req.prompt_len - 1) // self.nodes[0].engine.bs]
        guard = imbalanced([n.view.sequences for n in self.nodes], BALANCE)
        # drawn even when replayed (the coin keeps step), in the router's order: its registry lists
        # nodes by id as text, so decode-10 draws before decode-2
        coin = {id(n): self._rng.random() for n in sorted(self.nodes, key=lambda n: n.engine.name)}
        if req.replay_decode:           # where the measured run's router sent it, room or not
            ranked = [n for n in self.nodes if n.engine.name == req.replay_decode]
        else:
            ranked = sorted(self.nodes, key=lambda n: (n.view.sequences if guard else 0, n.view.beat_waiting,
                                                       blocks - n.engine.pool.hits(usable) + n.view.used_blocks,
                                                       coin[id(n)]))
        for node in ranked:
            seq = SimSeq(req, req.prompt_len, target=req.output_len)
            hits = node.engine.reserve(seq, req.output_len)
            if hits is not None:
                node.view.book(blocks)
                req.decode_node = node.engine.name
                return node, hits
        return None

    def busy_s(self) -> float:
        return sum(n.engine.busy_s for n in self.nodes)

    def preemptions(self) -> int:
        return sum(n.engine.preemptions for n in self.nodes)
