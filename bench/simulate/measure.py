"""The real half of the validation: the serving benchmark's rate points (bench/serving/compare.py,
same workloads, seeds and load generator) against colocated, 1P+1D and 1P+2D pdserve, each node
pinned to a core of its own where the machine has one, and one thread per node.

    colocated   the whole engine (and its HTTP front end) on core 0
    1P+1D       prefill-0 on core 0, decode-0 on core 1; the router floats
    1P+2D       prefill-0 on core 0, decode-0 and decode-1 share core 1 (2 cores: no third one)

Before and after each point's requests, while the servers are idle, every pinned core's speed is
probed (pdplan/speed_probe.py: the model's linears, in a process pinned there): validate.py
--probe-speed prices the point's simulated steps at it."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace

from bench.serving import record as rec
from bench.serving.compare import SweepSpec, _point, _warmup, free_port
from bench.serving.loadgen import LoadSpec, run_load
from bench.serving.workloads import WorkloadSpec, generate
from bench.serving.servers import REPO, Knobs, pdserve_colocated, pdserve_disaggregated, running
from bench.simulate import node_steps, placement
from bench.simulate.cpu_time import core_steal, deltas, sched_times
from bench.simulate.pinning import COLOCATED_ROOT, PINS, cmdline, pin_nodes, prioritize
from pdplan.speed_probe import probe_cores, record


def server(system: str, model: str, port: int, knobs: Knobs, flags: tuple[str, ...] = ()):
    """colocated, 1p1d or 1p2d, one thread per node (each is pinned to a core); flags: added to
    its command line (`measure --pdserve-flags`)."""
    if system == "colocated":
        spec = pdserve_colocated(model, port, knobs)
    else:
        spec = pdserve_disaggregated(model, port, knobs, decode=int(system[2]))
    return replace(spec, argv=spec.argv + flags, env=spec.env | {"OMP_NUM_THREADS": "1"})


WARMUP_SEED = 10**6 + 1     # not a point's seed: nothing the warm-up caches is a point's


def warmup(spec: SweepSpec) -> list:
    """compare.py's warm-up (2 short prompts), then WARMUP_OWN of the workload's own kind: a fresh
    server's first real-size requests run 1.3-4x slower than later ones (bench/README.md, plan5),
    and the simulator models a server past them."""
    return _warmup(spec) + generate(WorkloadSpec(spec.workload, WARMUP_OWN, WARMUP_SEED, spec.knobs.max_model_len,
                                                 output_cap=16))


WARMUP_OWN = 8


def measure(system: str, spec: SweepSpec, model: str, vocab: list[str], env: dict[str, str] | None = None) -> dict:
    """One system over the sweep's rates; the points are compare.py's, plus what was pinned and
    each pinned node's time on and waiting for its core during the point (cpu_time.py).
    env: added to the server's environment (trace.py: its tracing hook); without it, each point
    records its nodes' engine steps (node_steps.py) and a disaggregated run each request's decode
    node (placement.py)."""
    port = free_port()
    srv = server(system, model, port, spec.knobs, spec.pdserve_flags)
    log = os.path.join(rec.RESULTS, "logs", f"validate_{system}_{int(time.time())}.log")
    where = log[:-len(".log")] + "_steps" if env is None else None
    srv = replace(srv, env=srv.env | (env or {}) | (placement.env(where, REPO, node_steps.only(system)) if where else {}))
    out = {"system": system, "server": srv.record(), "points": []}
    with running(srv, log) as endpoint:
        root = _root(port)
        nodes = dict(PINS[system])
        default = nodes.pop(COLOCATED_ROOT, None)
        time.sleep(1.0)                     # the node processes are up: the router waited for them
        out["pinned"] = {str(k): v for k, v in pin_nodes(root, nodes, default).items()}
        out["cores"] = {node: sorted(cores) for node, cores in PINS[system].items()}   # what validate simulates
        out["autogroup_nice"] = {str(k): v for k, v in prioritize(root).items()}     # and the load generator's own
        out["autogroup_nice"]["client"] = prioritize(os.getpid()).get(os.getpid())
        print(f"[{system}] pinned {out['pinned']}", flush=True)
        warm = warmup(spec)
        asyncio.run(run_load(endpoint, warm, vocab, LoadSpec(float("inf"), deadline_s=240), "warm-up"))
        out["warmup_requests"] = len(warm)      # the router ranked them (validate.py: its coin)
        pids = {COLOCATED_ROOT if what.startswith("root") else what.split(" -> ")[0]: int(pid)
                for pid, what in out["pinned"].items()}
        floating = {"client": os.getpid()} | ({} if default is not None else {"router": root})
        for i, rate in enumerate(spec.rates):
            speed_before = probe_pinned(system, model, spec.knobs.dtype)
            before, t0 = {node: sched_times(pid) for node, pid in pids.items()}, time.monotonic()
            float_before = {what: sched_times(pid) for what, pid in floating.items()}
            steal_before = core_steal()
            point = _point(endpoint, spec, i, rate, vocab, system)
            point["cpu"] = deltas(before, {node: sched_times(pid) for node, pid in pids.items()})
            # the unpinned processes' work (the load generator, a disaggregated router): it runs on
            # whichever core is free, else beside a node (pdplan/sim_core.py: floating work)
            point["float_cpu"] = deltas(float_before, {what: sched_times(pid) for what, pid in floating.items()})
            t1 = time.monotonic()
            point["cpu_wall_s"] = round(t1 - t0, 3)
            # what the host took from each core meanwhile (a VM's steal: delays no model here predicts)
            point["core_steal_s"] = {c: round(s - steal_before.get(c, 0.0), 2) for c, s in core_steal().items()}
            point["loadavg_after"] = os.getloadavg()
            if where and system != "colocated":
                point["placement_found"] = placement.attach(point["requests"], placement.read(where))
            if where:
                point["steps"] = node_steps.read(where, system, t0, t1)
            point["speed"] = {"before": speed_before, "after": probe_pinned(system, model, spec.knobs.dtype)}
            out["points"].append(point)
    return out


PROBE_TIMEOUT_S = 60.0      # one core's probe: ~5 s of imports and ~2 s of work on this host


def probe_pinned(system: str, model: str, dtype: str) -> dict[str, dict | str]:
    """The speed of every core the system's nodes are pinned to, one after another (a core whose
    probe fails records its error: the run goes on)."""
    return record(probe_cores(model, dtype, set().union(*PINS[system].values()), PROBE_TIMEOUT_S))


def _root(port: int) -> int:
    """The server process: the lowest pid whose command line carries `--port <port>`."""
    mark = f"--port {port} "
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and mark in cmdline(int(p)) + " "]
    if not pids:
        raise RuntimeError(f"no process serves port {port}")
    return min(pids)
