"""How much of its core a node process got during a measured point (Linux /proc/<pid>/task/*/schedstat):
time on a core and time runnable but waiting for one, summed over the process's threads. A node
alone on an idle core waits ~0; wait / run is how much other work stretched its steps, which
validate.py hands to the simulator as background load on that core (pdplan/sim_core.py).

A virtual machine's cores also lose time to the host (steal: the hypervisor ran something else on
the physical core while this one was runnable); /proc/stat counts it per core (core_steal)."""
from __future__ import annotations

import os


def sched_times(pid: int) -> tuple[float, float]:
    """(seconds on a core, seconds runnable and waiting), over every thread of `pid`; (0, 0) if gone."""
    run = wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                r, w, _ = f.read().split()
        except (OSError, ValueError):
            continue
        run, wait = run + int(r), wait + int(w)
    return run / 1e9, wait / 1e9


def deltas(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, dict]:
    """Per node, what it ran and waited between two snapshots."""
    return {node: {"run_s": round(after[node][0] - b[0], 4), "wait_s": round(after[node][1] - b[1], 4)}
            for node, b in before.items()}


def core_steal(stat: str | None = None) -> dict[str, float]:
    """Seconds each core (cpu0, cpu1, ...) lost to the hypervisor since boot: /proc/stat's steal
    column (the 8th number, in USER_HZ ticks); {} where the kernel does not count it."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.read()
        except OSError:
            return {}
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for line in stat.splitlines():
        name, *ticks = line.split()
        if name.startswith("cpu") and name != "cpu" and len(ticks) >= 8:
            out[name] = int(ticks[7]) / hz
    return out
