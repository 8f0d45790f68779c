"""One simulated engine: the scheduler of engine/scheduler.py, step by step, on the event clock,
each step lasting what the profile says a step of that shape costs.

Each step (as the real scheduler):
  1. running sequences, decoding ones first: one token each, the next chunk for a prefilling
     one, under the token budget; a sequence that cannot get its next block preempts the
     latest-arrived running one (recompute: its blocks freed, back to the front of waiting),
     or itself
  2. waiting sequences in order while the budget, max_num_seqs and the blocks allow (prefix
     hits reused; the whole prompt's blocks allocated at admission, a watermark kept free)
  3. the step ends once its core has given it profile.step_seconds(shapes) (later if the core is
     shared with busy nodes, or another core of its machine prefills: sim_core.py, sim_bus.py):
     computed tokens move on, full prompt
     blocks enter the prefix cache, a sequence whose context is all computed samples a token
A decode node's reservations (reserve / adopt) hold blocks without running, and take none of its
core while their blocks are due (its loop sleeps until a frame lands). Control messages
reach a node between its steps (node_shell/runtime.py polls there): between_steps() defers what a
message does until the running step ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pdplan.block_pool import BlockPool
from pdplan.events import EventLoop
from pdplan.profile import Profile
from pdplan.sim_core import FloatingWork, SimCore
from pdplan.sim_request import SimRequest


class SimReserved(NamedTuple):
    hits: int       # leading prompt blocks found cached
    taken: int      # blocks taken from the available ones: new ones and cached hits no one held


@dataclass(frozen=True, slots=True)
class LoopCost:
    """Wall time the node's step loop adds to each step beyond the profile's price."""
    per_step_s: float = 0.0
    per_sample_s: float = 0.0       # per token the step samples (streaming it: node -> router -> client)
    admit_s: float = 0.0            # per request whose first chunk the step runs ...
    admit_token_s: float = 0.0      # ... and per prompt token of it

    def of(self, sampled: int, admitted: list[SimRequest]) -> float:
        return self.per_step_s + self.per_sample_s * sampled \
            + sum(self.admit_s + self.admit_token_s * r.prompt_len for r in admitted)


@dataclass(slots=True, eq=False)
class SimSeq:
    req: SimRequest
    length: int                     # tokens in the context: prompt + what was generated so far
    target: int                     # the sequence ends when `generated` reaches it
    generated: int = 0              # output tokens so far (a decode node starts at 1: P's token)
    computed: int = 0               # tokens whose K/V this node holds
    hashes: list[int] = field(default_factory=list)     # shared blocks held
    private: int = 0                # private blocks held
    started: bool = False           # a step has run some of it here

    @property
    def held(self) -> int:
        return len(self.hashes) + self.private

    @property
    def uncomputed(self) -> int:
        return self.length - self.computed


def _prefilling(seq: SimSeq) -> bool:
    return seq.length - seq.computed > 1


class Owner(Protocol):
    """What a pool does with an engine's progress."""
    def sampled(self, seq: SimSeq, t: float) -> None: ...
    def finished(self, seq: SimSeq, t: float) -> None: ...
    def computed(self, seq: SimSeq, before: int, t: float) -> None: ...


class SimEngine:
    def __init__(self, name: str, profile: Profile, loop: EventLoop, owner: Owner, streams: bool,
                 loop_cost: LoopCost = LoopCost(), core: SimCore | None = None,
                 floating: FloatingWork | None = None, float_per_token_s: float = 0.0):
        """streams: each sampled token goes to the client at the step's end (decode, colocated);
        otherwise the owner hears of it (a prefill node's first token). loop_cost: what the node's
        loop adds to each step. core: what the steps run on (default: a core of its own); a shared
        one stretches them (sim_core.py). Each streamed token gives `floating` float_per_token_s of
        work (the router's and the client's)."""
        self.name, self.profile, self.loop, self.owner = name, profile, loop, owner
        self.core = core or SimCore(loop)
        self.streams = streams
        self.bs = profile.block_size
        self.pool = BlockPool(profile.num_blocks)
        self.watermark = max(1, profile.num_blocks // 100)
        self.loop_cost = loop_cost
        self.waiting: list[SimSeq] = []
        self.running: list[SimSeq] = []
        self.reserved: dict[int, SimSeq] = {}
        self.stepping = False
        self._between: list = []        # what control messages do once the running step ends
        self.floating, self.float_per_token_s = floating, float_per_token_s
        self.busy_s = 0.0               # core time its steps took (the profile's prices)
        self.wall_s = 0.0               # wall time they took: more when the core is shared
        self._step_start = 0.0
        self.preemptions = 0

    # -- load, as the router sees it -----------------------------------------------------------
    def load(self) -> int:
        """Sequences running or waiting (a node's heartbeat figure)."""
        return len(self.running) + len(self.waiting)

    def num_seqs(self) -> int:
        return len(self.running) + len(self.reserved)

    # -- requests in -------------------------------------------------------------------------
    def add(self, seq: SimSeq) -> None:
        self.waiting.append(seq)
        self.kick()

    def reserve(self, seq: SimSeq, growth: int) -> SimReserved | None:
        """Blocks for the prompt, if they fit with room for `growth` more tokens; returns the
        leading blocks found cached here (not shipped) and the blocks taken from the available
        ones (engine/scheduler.py ReservedPrompt), or None (Busy)."""
        hits = self._hits(seq)
        need = self._blocks(seq.length) - hits + self._evictable(seq, hits)
        if need + -(-growth // self.bs) + self.watermark > self.pool.available:
            return None
        self._allocate(seq, hits)
        self.reserved[seq.req.rid] = seq
        return SimReserved(hits, need)

    def prefill_here(self, rid: int) -> None:
        """A reserved prompt computed by this node itself (the router's local prefill): it runs as
        any prefilling sequence and streams its first token."""
        self.running.append(self.reserved.pop(rid))
        self.kick()

    def adopt(self, rid: int) -> None:
        """Every block arrived: the prompt is computed and the sequence decodes from its first token."""
        seq = self.reserved.pop(rid)
        before, seq.computed = seq.computed, seq.length
        self._publish(seq, before)
        seq.generated, seq.length = 1, seq.length + 1
        self.running.append(seq)
        self.kick()

    def between_steps(self, fn) -> None:
        """fn() now if no step runs, else when the running one ends (before the next starts)."""
        if self.stepping:
            self._between.append(fn)
        else:
            fn()

    # -- the step loop -----------------------------------------------------------------------
    def kick(self) -> None:
        """Start a step if none runs and one can; a node left without one takes nothing of its core."""
        if self.stepping:
            return
        plan = self._schedule()
        if not plan:
            return
        sampled = sum(seq.computed + n == seq.length for seq, n in plan)
        admitted = [seq.req for seq, _ in plan if not seq.started]
        for seq, _ in plan:
            seq.started = True
        dt = self.profile.step.of([(n, seq.computed) for seq, n in plan]) + self.loop_cost.of(sampled, admitted)
        self.stepping, self._step_start = True, self.loop.now
        self.busy_s += dt             # core time: a step stretched by sharing counts its own work only
        self.core.run(dt, lambda: self._end_step(plan), self.name, any(n > 1 for _, n in plan))

    def _end_step(self, plan: list[tuple[SimSeq, int]]) -> None:
        """Nothing is preempted while a step runs (scheduling happens between steps)."""
        t = self.loop.now
        self.stepping = False
        self.wall_s += t - self._step_start
        streams, streamed = self.streams, 0
        for seq, n in plan:
            before = seq.computed
            seq.computed = before + n
            if before < seq.req.prompt_len:
                self._publish(seq, before)
                self.owner.computed(seq, before, t)
            if seq.computed == seq.length:
                seq.generated += 1
                if streams:
                    seq.req.token_times.append(t)
                    streamed += 1
                else:
                    self.owner.sampled(seq, t)
                if seq.generated >= seq.target:
                    self._finish(seq, t)
                else:
                    seq.length += 1
        between, self._between = self._between, []
        for fn in between:
            fn()
        self.kick()
        if streamed and self.floating is not None:      # placed once this node's next step holds its core
            self.floating.add(streamed * self.float_per_token_s)

    def _finish(self, seq: SimSeq, t: float) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.owner.finished(seq, t)

    def _schedule(self) -> list[tuple[SimSeq, int]]:
        budget = self.profile.max_num_batched_tokens
        cap = self.profile.long_prefill_token_threshold or budget      # a prompt's tokens a step, at most
        plan: list[tuple[SimSeq, int]] = []
        self._gone: set[int] = set()
        for seq in sorted(self.running, key=_prefilling):
            if budget <= 0:
                break
            if id(seq) in self._gone:
                continue
            n = min(seq.length - seq.computed, budget, cap)
            if self._grow(seq, n, plan):
                plan.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and self.num_seqs() < self.profile.max_num_seqs:
            seq = self.waiting[0]
            hits = self._hits(seq)
            need = self._blocks(seq.length) - hits + self._evictable(seq, hits)
            if need + (self.watermark if self.running else 0) > self.pool.available:
                break
            self.waiting.pop(0)
            self._allocate(seq, hits)
            self.running.append(seq)
            n = min(seq.uncomputed, budget, cap)
            plan.append((seq, n))
            budget -= n
        return plan

    def _grow(self, seq: SimSeq, n: int, plan: list[tuple[SimSeq, int]]) -> bool:
        """Blocks for `n` more tokens of `seq`, preempting the latest running sequences as needed;
        False if `seq` itself was preempted."""
        need = -(-(seq.computed + n) // self.bs) - len(seq.hashes) - seq.private
        if need <= 0:
            return True
        while need > self.pool.available:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.pool.take(need)
        seq.private += need
        return True

    def _preempt(self, seq: SimSeq, plan: list[tuple[SimSeq, int]]) -> None:
        self.running.remove(seq)
        plan[:] = [(s, n) for s, n in plan if s is not seq]
        self._gone.add(id(seq))
        self._free(seq)
        seq.computed = 0
        self.waiting.insert(0, seq)
        self.preemptions += 1

    # -- blocks ------------------------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def _hits(self, seq: SimSeq) -> int:
        """Leading cached prompt blocks, leaving at least the last token to compute."""
        return min(self.pool.hits(seq.req.block_hashes), (seq.length - 1) // self.bs)

    def _evictable(self, seq: SimSeq, hits: int) -> int:
        return sum(1 for h in seq.req.block_hashes[:hits] if h in self.pool.cached)

    def _allocate(self, seq: SimSeq, hits: int) -> None:
        held = tuple(seq.req.block_hashes[:hits])
        self.pool.acquire(held)
        seq.hashes, seq.computed = list(held), hits * self.bs
        seq.private = self._blocks(seq.length) - hits
        self.pool.take(seq.private)

    def _publish(self, seq: SimSeq, before: int) -> None:
        """Full prompt blocks computed by this step enter the prefix cache."""
        hashes = seq.req.block_hashes
        for i in range(before // self.bs, min(seq.computed // self.bs, len(hashes))):
            if i >= len(seq.hashes) and self.pool.publish(hashes[i]):
                seq.hashes.append(hashes[i])
                seq.private -= 1

    def _free(self, seq: SimSeq) -> None:
        self.pool.release(seq.hashes, seq.private)
        seq.hashes, seq.private = [], 0
