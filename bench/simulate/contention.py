"""The machine's other work during a measured point, as the simulator models it: per pinned core,
the background load b (runnable processes that never sleep, pdplan/sim_core.py) under which the
simulated nodes on that core wait for it as long, per second of work, as the measured nodes did
(their schedstat: cpu_time.py).

    measured   wait / run of the nodes on core c, summed         (0.4: a step took 1.4x its work)
    simulated  (wall - busy) / busy of the simulated nodes on c  (sibling nodes on c count too)
    b_c        found by bisection, each core in turn, twice (the cores interact only through the
               requests they pass on)

Only cores whose nodes were on them at least MIN_BUSY of the point are fitted: a node that runs in
short bursts (a prefill node between prompts) waits at each wake-up for a core whatever its
burst's length, so its wait / run measures wake-up latency, not a share of the core, and fitted
as a share it stretches every prefill step (TTFT 40-140% over on the ShareGPT-like runs).

The fit reads the run it then predicts; it says how much of a miss the machine's load explains,
not what the simulator predicts unaided (validate.py shows both).
"""
from __future__ import annotations

from typing import Callable

from pdplan.sim_metrics import SimSummary

MAX_BACKGROUND, STEPS, ROUNDS = 8.0, 14, 2
MIN_BUSY = 0.2                      # of the point's wall time, summed over the core's nodes


def measured_wait(point: dict, cores: dict[str, list[int]]) -> dict[int, float]:
    """Core id -> wait / run of the measured nodes pinned there (cores without data, or busy less
    than MIN_BUSY of the point, left out)."""
    run: dict[int, float] = {}
    wait: dict[int, float] = {}
    for node, t in point.get("cpu", {}).items():
        core = cores[node][0]
        run[core] = run.get(core, 0.0) + t["run_s"]
        wait[core] = wait.get(core, 0.0) + t["wait_s"]
    wall = point.get("cpu_wall_s", 0.0)
    return {c: wait[c] / run[c] for c in run if run[c] > MIN_BUSY * wall}


def simulated_wait(summary: SimSummary, cores: dict[str, list[int]], core: int) -> float:
    busy = sum(b for node, (b, _) in summary.node_times.items() if cores.get(node, [None])[0] == core)
    wall = sum(w for node, (_, w) in summary.node_times.items() if cores.get(node, [None])[0] == core)
    return (wall - busy) / busy if busy > 0 else 0.0


def fit_background(run: Callable[[dict[int, float]], SimSummary], target: dict[int, float],
                   cores: dict[str, list[int]]) -> dict[int, float]:
    """b per core such that the simulated wait / work on each core matches `target`."""
    background = {c: 0.0 for c in target}
    for _ in range(ROUNDS):
        for core, want in target.items():
            lo, hi = 0.0, MAX_BACKGROUND
            if simulated_wait(run(background | {core: 0.0}), cores, core) >= want:
                background[core] = 0.0
                continue
            for _ in range(STEPS):
                mid = (lo + hi) / 2
                got = simulated_wait(run(background | {core: mid}), cores, core)
                lo, hi = (mid, hi) if got < want else (lo, mid)
            background[core] = round((lo + hi) / 2, 3)
    return background
