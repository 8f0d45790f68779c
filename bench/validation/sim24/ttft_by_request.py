"""sim24: each request of a measured point lined up with its simulated twin (validate --node-speed kind's
pricing): kind, prompt and output lengths (checked equal), measured and simulated TTFT, and the simulated
request's path: local (prefilled on its decode node) or remote, with the remote one's wait for the
decode node's running step (its reservation's answer), its prefill queue and its prefill.
usage: ttft_by_request.py PROFILE MEASURED [WORKLOAD:SYSTEM:RATE ...]  (no filter: every point)"""
import json
import sys

import numpy as np

from bench.simulate import node_steps
from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan import prefill_pool, sim_router
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate

PATH: dict[int, dict] = {}


def watch():
    """Records per request: reserved (its decode node said yes), submitted (the prefill node got it)."""
    try_ = sim_router.SimRouter._try

    def _try(self, req, probe=False):
        before = self.local_prefills
        ok = try_(self, req, probe)
        if ok:
            PATH[req.rid] = {"reserved": self.loop.now, "local": self.local_prefills > before}
        return ok
    sim_router.SimRouter._try = _try
    submit = prefill_pool.PrefillNode.submit

    def _submit(self, req, skip, on_first_token, on_commit):
        PATH[req.rid]["submitted"] = self.loop.now
        return submit(self, req, skip, on_first_token, on_commit)
    prefill_pool.PrefillNode.submit = _submit


def run_point(profile, sweep, out, i, p, nproc):
    PATH.clear()
    reqs = point_requests(sweep, i, p["rate"], profile, p.get("requests"))
    speed = node_steps.speed_map(p.get("steps"), profile.step, "kind")
    slo = SLOTargets(sweep["slo"]["ttft_ms"], sweep["slo"]["tpot_ms"])
    sim = simulate(profile, reqs, topology(out["system"], out, nproc), slo, ranked_before=ranked_before(out, i),
                   speed=speed)
    return reqs, sim, speed


def show(label, reqs, measured, sim):
    mt = [m["ttft_ms"] for m in measured]
    print(f"## {label}: TTFT p90 measured {np.percentile(mt, 90):.0f} simulated {sim.ttft_ms.p90:.0f} ms; "
          f"p50 {np.percentile(mt, 50):.0f} / {sim.ttft_ms.p50:.0f} (M, S: the requests above the p90 and the one below it)")
    k = len(reqs) - int(0.9 * (len(reqs) - 1))      # np.percentile's p90 lies between the k-th and (k-1)-th largest
    top_m = {m["id"] for m in sorted(measured, key=lambda m: -m["ttft_ms"])[:k]}
    top_s = {r.rid for r in sorted(reqs, key=lambda r: -(r.ttft if r.token_times else 0))[:k]}
    for r, m in zip(reqs, measured):
        assert (m["kind"], m["prompt_len"], m["output_len"]) == (r.kind, r.prompt_len, r.output_len), (m, r)
        s = 1e3 * r.ttft if r.token_times else float("nan")
        path = PATH.get(r.rid, {})
        where = "" if not path else "local " if path["local"] else \
            f"remote wait {1e3 * (path['submitted'] - path['reserved']):4.0f} reserve@{1e3 * (path['reserved'] - r.arrival):5.0f}"
        flag = ("M" if m["id"] in top_m else " ") + ("S" if r.rid in top_s else " ")
        print(f"  {r.rid:3} {flag} {r.kind:9} prompt {r.prompt_len:5} out {r.output_len:4} sent {r.arrival:7.2f} s "
              f"TTFT {m['ttft_ms']:7.0f} / {s:7.0f} ms ({s - m['ttft_ms']:+6.0f})  decode {m.get('decode_node', '-'):8}/"
              f"{r.decode_node or '-':8} {where}")


def main(profile_path, path, wanted):
    watch()
    profile = Profile.load(profile_path)
    d = json.load(open(path))
    sweep = d["sweep"]
    for system, out in d["systems"].items():
        for i, p in enumerate(out["points"]):
            label = f"{sweep['workload']}:{system}:{p['rate']}"
            if wanted and label not in wanted:
                continue
            reqs, sim, speed = run_point(profile, sweep, out, i, p, d["machine"]["nproc"])
            print(f"# speeds {({n: str(k) for n, k in (speed or {}).items()})}")
            show(label, reqs, p["requests"], sim)


main(sys.argv[1], sys.argv[2], set(sys.argv[3:]))
