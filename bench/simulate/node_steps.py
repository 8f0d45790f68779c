"""Each node's engine steps during a measured point, and the speed they ran at against the profile
(issue #18: the machine's speed drifts 15-30% between a profile and a point; a node's own steps,
timed during the point, say how fast it ran then).

    measure    the server runs with the trace hook's step record alone (trace_points.py: the
               engine's step and its scheduler's plan, ~65 us a step; env(dir)); each point keeps
               its nodes' steps: point["steps"][node] = [NodeStep.line(), ...]
    validate   --node-speed: each simulated node priced at point_speeds(): the median over its
               steps of measured / priced (its steps' thread CPU by default, or their wall);
               --node-speed kind: kind_speeds(), thread CPU, a step's decoding rows at the node's
               decode-only steps' median, its short and its long prompt chunks' rows each at the
               median of the point's prompt steps of that kind (pdplan/kind_cost.py: the three ran
               at different speeds)

A step line: "<wall s> <thread CPU s> <new>:<context> ... @<start s>" (one pair per scheduled
sequence; the start, after the point's, from sim22 on), one string per step so that the measure
file (indent=1) keeps a step on one line.
"""
from __future__ import annotations

import statistics
from typing import NamedTuple

from bench.simulate.placement import ROUTER_SENDS
from bench.simulate.trace import load
from pdplan.kind_cost import KindCost, KindSpeed

ENGINE_STEPS = "engine.llm_engine,engine.scheduler"    # trace_points.PATCHES: the step and its plan
MIN_STEPS = 20          # fewer steps on a node: the median over the point's steps (every node's), else 1.0
MIN_PROMPT_STEPS = 5    # fewer prompt steps in a point: its nodes' prompt rows at their decode factor
PROMPT_SHARE = 0.5      # a prompt step: its prompt rows are at least this share of its price
COLOCATED = "colocated-0"


class NodeStep(NamedTuple):
    wall_s: float                       # the step's start to its end
    cpu_s: float                        # its thread's CPU time meanwhile (not the core's wait)
    shapes: tuple[tuple[int, int], ...]  # (new tokens, context before them) per scheduled sequence
    start_s: float = -1.0               # its start, seconds after the point's (-1: a file from before sim22);
                                        # lines up two nodes' steps on one core in time

    def line(self) -> str:
        at = f" @{self.start_s:.4f}" if self.start_s >= 0 else ""
        return f"{self.wall_s:.6f} {self.cpu_s:.6f} " + " ".join(f"{n}:{c}" for n, c in self.shapes) + at

    @classmethod
    def parse(cls, line: str) -> "NodeStep":
        wall, cpu, *rest = line.split()
        start = next((float(x[1:]) for x in rest if x.startswith("@")), -1.0)
        pairs = tuple(tuple(int(x) for x in p.split(":")) for p in rest if not p.startswith("@"))
        return cls(float(wall), float(cpu), pairs, start)


class NodeSpeed(NamedTuple):
    factor: float | KindSpeed   # the node's steps are priced this many times the profile's (per row kind)
    steps: int          # steps the node recorded during the point
    source: str         # "node": the median of its own steps; too few of them: "point", the median
                        # of all the point's steps (every node's); too few of those too: "none", 1.0


def only(system: str) -> str:
    """The trace hook's patches a measure run installs: steps, and the router's sends when disaggregated."""
    return ENGINE_STEPS if system == "colocated" else f"{ENGINE_STEPS},{ROUTER_SENDS}"


def read(out_dir: str, system: str, t0: float, t1: float) -> dict[str, list[str]]:
    """Node -> the lines of its steps that started and ended within [t0, t1] (time.monotonic(), the
    hook's clock), in order. The colocated server's steps are colocated-0's (its process is the router)."""
    out: dict[str, list[str]] = {}
    for e in load(out_dir):
        if e["e"] == "step" and e.get("shapes") and t0 <= e["t0"] and e["t"] <= t1:
            node = COLOCATED if system == "colocated" else e["p"]
            step = NodeStep(e["t"] - e["t0"], e["cpu"], tuple(tuple(s) for s in e["shapes"]), e["t0"] - t0)
            out.setdefault(node, []).append(step.line())
    return out


def point_speeds(steps: dict[str, list[str]], step_cost, basis: str = "cpu",
                 min_steps: int = MIN_STEPS) -> dict[str, NodeSpeed]:
    """Node -> its speed: the median of measured / priced over its steps (basis "cpu": each step's
    thread CPU, its own work; "wall": its wall time, which also counts the core's other work: a
    sibling node on a shared core, other processes). A node with fewer than `min_steps` steps (a
    few scatter 0.7-1.8x: bench/README.md, sim20; a prefill node whose prompts mostly went to the
    decode node's local prefill) takes the median over all the point's steps, the machine's speed
    then; with fewer than `min_steps` in all, 1.0."""
    ratios = {node: _ratios(lines, step_cost, basis) for node, lines in sorted(steps.items())}
    pooled = [r for rs in ratios.values() for r in rs]
    fallback = NodeSpeed(statistics.median(pooled), 0, "point") if len(pooled) >= min_steps else NodeSpeed(1.0, 0, "none")
    return {node: NodeSpeed(statistics.median(rs), len(rs), "node") if len(rs) >= min_steps
            else fallback._replace(steps=len(rs)) for node, rs in ratios.items()}


def kind_speeds(steps: dict[str, list[str]], step_cost, min_steps: int = MIN_STEPS) -> dict[str, NodeSpeed]:
    """Node -> KindSpeed: decode, point_speeds (thread CPU) over the node's decode-only steps (its
    fallbacks: the point's decode-only steps, 1.0); prompt and long, each the median over the point's
    prompt steps of that kind (prompt rows >= PROMPT_SHARE of its price; few per node: a prefill node
    runs 2-20 a point; a long one: its long chunks' rows at least half its prompt rows, kind_cost.py)
    of its CPU less its decode part at its node's decode factor, over its prompt part. A kind with
    fewer than MIN_PROMPT_STEPS such steps takes the median over every prompt step of the point; with
    fewer than that in all, each node's prompt rows are at its decode factor."""
    parsed = {node: [NodeStep.parse(x) for x in lines] for node, lines in steps.items()}
    decoding = {node: [s.line() for s in st if all(n == 1 for n, _ in s.shapes)] for node, st in parsed.items()}
    decode = point_speeds(decoding, step_cost, "cpu", min_steps)
    split = KindCost(step_cost, KindSpeed(1.0, 1.0))
    implied: dict[bool, list[float]] = {False: [], True: []}     # long? -> each prompt step's factor
    for node, st in parsed.items():
        for s in st:
            parts = split.parts(list(s.shapes))
            if parts.prompt >= PROMPT_SHARE * (parts.decode + parts.prompt):
                implied[parts.long >= parts.short].append((s.cpu_s - decode[node].factor * parts.decode) / parts.prompt)
    pooled = implied[False] + implied[True]

    def factor(kind: list[float], node: str) -> float:
        if len(kind) >= MIN_PROMPT_STEPS:
            return statistics.median(kind)
        return statistics.median(pooled) if len(pooled) >= MIN_PROMPT_STEPS else decode[node].factor
    return {node: v._replace(factor=KindSpeed(v.factor, factor(implied[False], node), factor(implied[True], node)),
                             steps=len(parsed[node]))
            for node, v in decode.items()}


def node_speeds(steps: dict[str, list[str]], step_cost, basis: str) -> dict[str, NodeSpeed]:
    """point_speeds on basis "cpu" or "wall", kind_speeds on "kind"."""
    return kind_speeds(steps, step_cost) if basis == "kind" else point_speeds(steps, step_cost, basis)


def speed_map(steps: dict[str, list[str]] | None, step_cost, basis: str = "") -> dict | None:
    """Node -> its factor (node_speeds) for simulate(speed=...); None without a basis or steps."""
    if not basis or not steps:
        return None
    return {node: s.factor for node, s in node_speeds(steps, step_cost, basis).items()}


class Outside(NamedTuple):
    cpu_s: float        # the node process's CPU (schedstat run, every thread) less its steps' thread CPU
    share: float        # that per second of the point (its cpu_wall_s): a core's share it took outside steps


def outside_steps(point: dict) -> dict[str, Outside]:
    """Node -> the CPU its process spent outside its engine steps during a measured point (its loop:
    receiving blocks and requests, streaming, heartbeats; sim23). Nodes the point has no schedstat
    or no steps for are left out."""
    cpu, wall = point.get("cpu", {}), point.get("cpu_wall_s", 0.0)
    out = {}
    for node, lines in sorted(point.get("steps", {}).items()):
        if node in cpu and wall > 0:
            left = cpu[node]["run_s"] - sum(NodeStep.parse(x).cpu_s for x in lines)
            out[node] = Outside(left, left / wall)
    return out


def _ratios(lines: list[str], step_cost, basis: str) -> list[float]:
    steps = [NodeStep.parse(x) for x in lines]
    return [(s.cpu_s if basis == "cpu" else s.wall_s) / step_cost.of(list(s.shapes)) for s in steps]
