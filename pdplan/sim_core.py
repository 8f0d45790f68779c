"""A simulated core (or device) that engines' steps run on, shared by processor sharing.

A node with a core of its own (a separate host: the planner's default) runs each step in exactly
the time the profile prices it. Nodes pinned to one core (the validation runs' 1P+2D on this
2-core machine: both decode nodes on core 1) time-share it as the OS does: while k of them are in
a step, each step's remaining work advances at 1/k of the core's speed; a node between steps
(idle, or a decode node waiting for a transfer's blocks: its loop sleeps until a frame lands,
node_shell/runtime.py) takes nothing. Other work on the machine (a shared test box) can be given
as `background`: b runnable processes that never sleep, so k steps advance at 1/(k + b) each.

Processes pinned nowhere (the load generator; a disaggregated deployment's router) are floating
work (FloatingWork): CPU seconds per streamed token that the OS runs on an idle core of the machine
if there is one, else beside a node on the core it last ran on, where it shares the core like a
step. In the validation's 1P+1D (prefill on core 0, decode on core 1) the stream of one request
keeps the decode core busy and its tokens' work lands on the prefill node's core, so a prompt
prefilled while another request streams waits for the core: traced, a prefill step beside a busy
decode node took 1.1-2.1x its own CPU time, one with the decode node idle 1.0-1.03x
(bench/README.md, "What the trace found"). Those processes also spend CPU every second of a run
whatever streams (heartbeats, polls, their event loops: 16-29 ms a second for the router, 6-12 for
the load generator, fitted over eight validation sets: bench/README.md, sim28), which
FloatingWork.steady adds in small pieces while the run lasts. With no machine given (separate
hosts) it costs nothing.

The cores of one machine share its L3 and memory bus: traced, a decode step's own CPU was
0.97-1.02x its price with the prefill node idle and 1.05-1.15x while the prefill node ran a step
on the other core (bench/README.md, plan8). A machine's cores (CoreMap with machine_cores) are tied
by a SharedBus (sim_bus.py): while another core of it runs a prefill step, a core's steps need
`slow` times their price of its time (slow_to). Separate hosts share nothing.

    work left     ████████░░░░      a step of 80 ms alone ends 80 ms after it starts; if another
                  ▲ start   ▲ end   node's step starts 40 ms in, both advance at half speed: the
                                    first ends 80 ms later (at 120 ms), the other's work from then
                                    on at full speed again
"""
from __future__ import annotations

from typing import Callable

from pdplan.events import EventLoop
from pdplan.sim_bus import SharedBus


class SimCore:
    def __init__(self, loop: EventLoop, background: float = 0.0):
        self.loop, self.background = loop, background
        self._jobs: dict[int, list] = {}        # job id -> [work left (s), on_done, owner, prefill]
        self._next_id = 0
        self._since = 0.0                       # when the work left was last brought up to date
        self._version = 0                       # the one finish event still valid
        self.slow = 1.0                         # core time per second of price (another core's prefill: sim_bus.py)
        self.bus = None                         # the SharedBus of this core's machine, if any
        self.prefilling = 0                     # prefill steps running here (the bus tells the other cores)
        self.bus_cpu: dict[str, float] = {}     # owner -> core seconds its steps took beyond their price (slow)

    def run(self, work_s: float, on_done: Callable[[], None], owner: str = "", prefill: bool = False) -> None:
        """One step of `work_s` seconds of this core's time (at slow 1); on_done() when it has had
        them. owner: whose step (bus_cpu); prefill: a step that computes a prompt's tokens, which
        slows the other cores of a shared bus while it runs."""
        self._advance()
        self._jobs[self._next_id] = [work_s, on_done, owner, prefill]
        self._next_id += 1
        self.prefilling += prefill
        self._schedule()
        if prefill and self.bus is not None:
            self.bus.changed()

    def slow_to(self, slow: float) -> None:
        """From now on each step here needs `slow` seconds of the core per second of its price."""
        if slow == self.slow:
            return
        self._advance()
        self.slow = slow
        self._schedule()

    @property
    def sharing(self) -> int:
        """Steps running on this core now."""
        return len(self._jobs)

    def _advance(self) -> None:
        """Every running step gets its share of the time since the last change."""
        now = self.loop.now
        if self._jobs:
            share = (now - self._since) / (len(self._jobs) + self.background)
            for job in self._jobs.values():
                job[0] -= share / self.slow
                if self.slow != 1.0:
                    self.bus_cpu[job[2]] = self.bus_cpu.get(job[2], 0.0) + share * (1 - 1 / self.slow)
        self._since = now

    def _schedule(self) -> None:
        self._version += 1
        if not self._jobs:
            return
        version, left = self._version, min(job[0] for job in self._jobs.values())
        self.loop.after(max(left, 0.0) * (len(self._jobs) + self.background) * self.slow, lambda: self._finish(version))

    def _finish(self, version: int) -> None:
        if version != self._version:
            return                              # the set of steps changed since: a newer event stands
        self._advance()
        done = [jid for jid, job in self._jobs.items() if job[0] <= 1e-9]     # 1 ns: float residue
        jobs = [self._jobs.pop(jid) for jid in done]
        prefills = sum(job[3] for job in jobs)
        self.prefilling -= prefills
        self._schedule()
        if prefills and self.bus is not None:
            self.bus.changed()
        for cb in (job[1] for job in jobs):
            cb()


STEADY_TICK_S = 0.02     # how often floating work's per-second share is added (FloatingWork.steady)


class FloatingWork:
    """Work that no process pin holds: run on an idle core of the machine (the one it last ran on
    if that one is idle, else the lowest idle one), or, with none idle, on the core it last ran on
    beside the node there. Work that comes while some runs waits and goes in one batch after it."""

    def __init__(self, cores: list[SimCore]):
        self.cores = cores              # every core of the machine; none: the work costs nothing here
        self.pending = 0.0
        self.running = False
        self.last = 0
        self.cpu_s = 0.0

    def add(self, work_s: float) -> None:
        if not self.cores or work_s <= 0:
            return
        self.pending += work_s
        if not self.running:
            self._start()

    def steady(self, loop: EventLoop, per_s: float, running: Callable[[], bool], tick_s: float = STEADY_TICK_S) -> None:
        """Also per_s CPU seconds a second, whatever streams (a router's heartbeats and polls, a load
        generator's loop), added every tick_s while running() holds and anything else is scheduled."""
        if not self.cores or per_s <= 0:
            return

        def tick() -> None:
            if running() and loop.pending:
                self.add(per_s * tick_s)
                loop.after(tick_s, tick)
        loop.after(tick_s, tick)

    def _start(self) -> None:
        work, self.pending = self.pending, 0.0
        idle = [i for i, c in enumerate(self.cores) if not c.sharing]
        if idle and self.last not in idle:
            self.last = idle[0]
        self.running = True
        self.cpu_s += work
        self.cores[self.last].run(work, self._done)

    def _done(self) -> None:
        self.running = False
        if self.pending > 0:
            self._start()


class CoreMap:
    """Which SimCore each node steps on: nodes pinned to the same core id share one; every other
    node gets a core of its own. background: core id -> runnable processes of other work there.
    machine_cores: the cores of the machine the pinned nodes run on (0: not one machine; floating
    work is then free). beside_prefill: on that machine, a step's price multiplier while another
    of its cores runs a prefill step (sim_bus.py; 1: none)."""

    def __init__(self, loop: EventLoop, pins: tuple[tuple[str, int], ...] = (),
                 background: dict[int, float] | None = None, machine_cores: int = 0, beside_prefill: float = 1.0):
        self.loop = loop
        self._pins = dict(pins)
        self._background = background or {}
        self._shared: dict[int, SimCore] = {}
        self.floating = FloatingWork([self._core(i) for i in range(machine_cores)])
        if machine_cores > 1 and beside_prefill != 1.0:
            SharedBus(self.floating.cores, beside_prefill)

    def of(self, node: str) -> SimCore:
        core = self._pins.get(node)
        if core is None:
            return SimCore(self.loop)
        return self._core(core)

    def _core(self, core: int) -> SimCore:
        if core not in self._shared:
            self._shared[core] = SimCore(self.loop, self._background.get(core, 0.0))
        return self._shared[core]
