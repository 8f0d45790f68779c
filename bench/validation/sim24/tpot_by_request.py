"""sim24: each request of one point, measured TPOT against simulated (validate --node-speed kind), with its
decode node measured / simulated and when its last token came (seconds after the point's start).
usage: tpot_by_request.py PROFILE MEASURED SYSTEM POINT_INDEX"""
import json
import sys

from bench.simulate import node_steps
from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate


def main(profile_path, path, system, i):
    profile, d = Profile.load(profile_path), json.load(open(path))
    out, sweep = d["systems"][system], d["sweep"]
    p = out["points"][i]
    reqs = point_requests(sweep, i, p["rate"], profile, p.get("requests"))
    speed = node_steps.speed_map(p.get("steps"), profile.step, "kind")
    sim = simulate(profile, reqs, topology(system, out, d["machine"]["nproc"]), SLOTargets(),
                   ranked_before=ranked_before(out, i), speed=speed)
    for r, m in zip(reqs, p["requests"]):
        tpot = (m["e2el_ms"] - m["ttft_ms"]) / (m["output_tokens"] - 1)
        print(f"{r.rid:3} {r.kind:9} sent {r.arrival:6.1f} out {r.output_len:4} TPOT {tpot:6.1f} / {1e3 * r.tpot:6.1f} ms  "
              f"decode {m['decode_node']}/{r.decode_node}  end {r.arrival + m['e2el_ms'] / 1e3:6.1f} / {r.token_times[-1]:6.1f} s")
    print(f"TPOT p50 simulated {sim.tpot_ms.p50:.1f} ms")


main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
