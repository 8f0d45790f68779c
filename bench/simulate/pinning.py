"""Core pinning for the validation runs: each node process gets its own core, as a separate host
would (Linux: sched_setaffinity on every thread of the process)."""
from __future__ import annotations

import os

# The validation runs' layout on this 2-core machine: node id -> its cores. The simulator reads the
# same map (pdplan Topology.pinned), so a simulated deployment has the measured one's layout.
# "colocated-0" is the colocated server's root process (its engine and HTTP front end); in the
# disaggregated runs the router floats.
PINS: dict[str, dict[str, set[int]]] = {
    "colocated": {"colocated-0": {0}},
    "1p1d": {"prefill-0": {0}, "decode-0": {1}},
    "1p2d": {"prefill-0": {0}, "decode-0": {1}, "decode-1": {1}},   # no third core: the decodes share
}
COLOCATED_ROOT = "colocated-0"


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc), depth first."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return [d for k in kids for d in (k, *children(k))]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` onto `cores` (threads started later inherit the mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass


def pin_nodes(root: int, plan: dict[str, set[int]], default: set[int] | None = None) -> dict[int, str]:
    """Pins each descendant of `root` whose command line names a node id in `plan` (e.g.
    {"prefill-0": {0}, "decode-0": {1}}); `default` (if given) pins `root` itself. Returns the
    pids pinned, each with what it is."""
    done = {}
    if default is not None:
        pin(root, default)
        done[root] = f"root -> {sorted(default)}"
    for pid in children(root):
        line = cmdline(pid)
        for node_id, cores in plan.items():
            if f"--node-id {node_id} " in line + " ":
                pin(pid, cores)
                done[pid] = f"{node_id} -> {sorted(cores)}"
    return done


BENCH_AUTOGROUP_NICE = -10      # the measured servers' scheduling groups, against everything else's 0


def prioritize(root: int, nice: int = BENCH_AUTOGROUP_NICE) -> dict[int, int | None]:
    """Gives `root` and its descendants' autogroups (Linux, kernel.sched_autogroup_enabled) the
    weight of `nice`. The CFS shares a core between sessions' autogroups before it looks at a
    task's own nice, and `pdserve up` starts each node in a session of its own: so a node weighs
    no more than another session's `nice -n 19` test, and the helpers' niced work takes half a
    core from it (seen: a niced pytest at 50-60% of a core beside a node). Needs root (a lower
    nice); returns each pid's autogroup nice after, None where it could not be set."""
    done = {}
    for pid in (root, *children(root)):
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(nice))
            with open(f"/proc/{pid}/autogroup") as f:
                done[pid] = int(f.read().rsplit("nice", 1)[1])
        except (OSError, ValueError, IndexError):
            done[pid] = None
    return done
