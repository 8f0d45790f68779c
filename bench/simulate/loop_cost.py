"""What a server's step loop costs its engine beyond the engine's own steps, from traces
(trace.py): the wall time the engine thread loses around each step,

    lost(step) = (step wall - step's own thread CPU) + (next step's start - this step's end)

over every traced step of one node kind that the next step follows within 50 ms (a busy loop;
a longer gap is the loop waiting for work): the step stretched while another thread of its
process held the GIL or the core, and the loop's work between steps. Two figures:

    per step      the median lost of the busy steps that start no request
    admission     lost of the steps that start one request against its prompt's tokens: the line
                  through the medians of the shortest and the longest third (trace.py thirds_line),
                  less the per-step figure (what starting a request adds to a step)

A colocated server (router/colocated.py) runs its HTTP front end in the engine's process, on the
engine's core: the event loop builds each request's response and sends each token, holding the
GIL, while the engine thread steps; traced (06:08-06:13 UTC, load 5.7-7), the first step of a
request stretched by 4, 8 or 12 ms (the GIL's 5 ms switch interval), the more the longer the
prompt (median 2 ms under 128 tokens, 7.7 ms over 2,600), where a decode node's local prefill
lost 0.7-2 ms whatever the prompt. A decode node's loop (node_shell) sends its tokens and reads
control messages between steps, with no HTTP in its process. The simulator's calibration
(calibrate.py: token_s and request_s on the ShareGPT-like runs) absorbs a decode node's loop;
what a colocated server's loses beyond it, both traced, is `colocated_extra`, which the simulated
colocated engine adds to its steps (pdplan/profile.py Overheads.colocated_*).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.simulate.trace import load, thirds_line, warmup_requests

BUSY_GAP_S = 0.05       # a longer gap between two steps: the loop was waiting for work
COLOCATED_ROLE = "router"   # trace_points' role of the colocated server's process (`python -m router`)


@dataclass(frozen=True, slots=True)
class LoopLoss:
    """What a traced server loop lost around its engine's steps (pdplan's LoopCost charges it in a simulation)."""
    per_step_s: float           # a busy step that starts no request
    admit_s: float              # a step that starts a request, beyond a plain step: at 0 prompt tokens ...
    admit_token_s: float        # ... and per prompt token
    steps: int                  # busy steps read
    admissions: int             # of which starting one request


def loop_cost(out_dirs: list[str], role: str) -> LoopLoss:
    """The loop cost of the processes whose trace role starts with `role` (COLOCATED_ROLE, or
    "decode") over the traced points of `out_dirs`."""
    plain, admitted = [], []
    for d in out_dirs:
        for prompt, lost in _steps(d, role):
            (admitted if prompt else plain).append((prompt, lost))
    if len(plain) < 3 or len(admitted) < 3:
        raise ValueError(f"{len(plain)} busy and {len(admitted)} admitting {role} steps in {out_dirs}: too few")
    start, per_token = thirds_line(admitted)
    per_step = statistics.median(lost for _, lost in plain)
    return LoopLoss(per_step, start - per_step, per_token, len(plain) + len(admitted), len(admitted))


def colocated_extra(colocated_dirs: list[str], decode_dirs: list[str]) -> tuple[float, float, float]:
    """(per step, per request started, per prompt token of it) seconds a colocated server's loop
    loses beyond a decode node's (each at least 0)."""
    c, d = loop_cost(colocated_dirs, COLOCATED_ROLE), loop_cost(decode_dirs, "decode")
    return (max(0.0, c.per_step_s - d.per_step_s), max(0.0, c.admit_s - d.admit_s),
            max(0.0, c.admit_token_s - d.admit_token_s))


def _steps(out_dir: str, role: str) -> list[tuple[int, float]]:
    """(prompt tokens of the request it starts, 0 if none; lost) for each busy step of the point
    that starts at most one request (the warm-up's requests left out: a step counts once the
    point's first request reached the server). A request's prompt: its last chunk's context and
    new tokens."""
    events = load(out_dir)
    starts = sorted((e for e in events if e["e"] == "gen_start"), key=lambda e: e["t"])
    since = starts[warmup_requests(out_dir)]["t"] if len(starts) > warmup_requests(out_dir) else 0.0
    out = []
    for node in sorted({e["p"] for e in events if e["e"] == "step" and e["p"].startswith(role)}):
        steps = sorted((e for e in events if e["e"] == "step" and e["p"] == node and "cpu" in e), key=lambda e: e["t0"])
        prompt = {rid: n + c for s in steps
                  for (n, c), (rid, _) in zip([x for x in s["shapes"] if x[0] > 1], s["chunks"])}
        seen: set[str] = set()
        for a, b in zip(steps, steps[1:]):
            started = {rid for rid, _ in a["chunks"]} - seen
            seen |= started
            gap = b["t0"] - a["t"]
            if a["t0"] >= since and gap <= BUSY_GAP_S and len(started) <= 1:
                out.append((sum(prompt[r] for r in started), a["t"] - a["t0"] - a["cpu"] + gap))
    return out
