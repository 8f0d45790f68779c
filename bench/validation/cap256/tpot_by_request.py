"""Each request of one measured point, TTFT and TPOT measured against simulated (validate --node-speed kind's
pricing, the server's --long-prefill-token-threshold read off its command line), and when its last token came.
usage: tpot_by_request.py CALIBRATED_PROFILE MEASURED SYSTEM POINT_INDEX"""
import json, sys, statistics
from bench.simulate import node_steps
from bench.simulate.validate import point_requests, ranked_before, topology, served_as
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate
profile_path, path, system, i = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
d = json.load(open(path)); out, sweep = d["systems"][system], d["sweep"]
profile = served_as(Profile.load(profile_path), out["server"]["argv"])
p = out["points"][i]
reqs = point_requests(sweep, i, p["rate"], profile, p.get("requests"))
speed = node_steps.speed_map(p.get("steps"), profile.step, "kind")
sim = simulate(profile, reqs, topology(system, out, d["machine"]["nproc"]), SLOTargets(), ranked_before=ranked_before(out, i), speed=speed)
rows=[]
for r, m in zip(reqs, p["requests"]):
    tpot = (m["e2el_ms"] - m["ttft_ms"]) / (m["output_tokens"] - 1)
    rows.append((r.rid, r.kind, r.arrival, r.prompt_len, r.output_len, tpot, 1e3*r.tpot))
    print(f"{r.rid:3} {r.kind:5} sent {r.arrival:6.1f} prompt {r.prompt_len:5} out {r.output_len:4} TTFT {m['ttft_ms']:7.0f} / {1e3*r.ttft:7.0f} TPOT {tpot:6.1f} / {1e3*r.tpot:6.1f} ms ({1e3*r.tpot/tpot-1:+.0%}) end {r.arrival + m['e2el_ms']/1e3:6.1f} / {r.token_times[-1]:6.1f}")
print("cap", profile.long_prefill_token_threshold, "TPOT p50 measured", statistics.median(x[5] for x in rows), "sim", statistics.median(x[6] for x in rows))
