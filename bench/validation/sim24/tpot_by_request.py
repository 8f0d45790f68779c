"""sim24: each request of one point, measured TTFT and TPOT against simulated (validate --node-speed kind's
pricing, with the server's --long-prefill-token-threshold read off its command line), with its decode node
measured / simulated (disaggregated points) and when its last token came (seconds after the point's start).
usage: tpot_by_request.py PROFILE MEASURED SYSTEM POINT_INDEX"""
import json
import statistics
import sys

from bench.simulate import node_steps
from bench.simulate.validate import point_requests, ranked_before, served_as, topology
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate


def main(profile_path, path, system, i):
    d = json.load(open(path))
    out, sweep = d["systems"][system], d["sweep"]
    profile = served_as(Profile.load(profile_path), out.get("server", {}).get("argv", []))
    p = out["points"][i]
    reqs = point_requests(sweep, i, p["rate"], profile, p.get("requests"))
    speed = node_steps.speed_map(p.get("steps"), profile.step, "kind")
    sim = simulate(profile, reqs, topology(system, out, d["machine"]["nproc"]), SLOTargets(),
                   ranked_before=ranked_before(out, i), speed=speed)
    measured = []
    for r, m in zip(reqs, p["requests"]):
        tpot = (m["e2el_ms"] - m["ttft_ms"]) / (m["output_tokens"] - 1)
        measured.append(tpot)
        decode = f"  decode {m['decode_node']}/{r.decode_node}" if "decode_node" in m else ""
        print(f"{r.rid:3} {r.kind:9} sent {r.arrival:6.1f} prompt {r.prompt_len:5} out {r.output_len:4} "
              f"TTFT {m['ttft_ms']:7.0f} / {1e3 * r.ttft:7.0f} ms  TPOT {tpot:6.1f} / {1e3 * r.tpot:6.1f} ms "
              f"({1e3 * r.tpot / tpot - 1:+.0%}){decode}  end {r.arrival + m['e2el_ms'] / 1e3:6.1f} / {r.token_times[-1]:6.1f} s")
    print(f"TPOT p50 measured {statistics.median(measured):.1f} ms, simulated {sim.tpot_ms.p50:.1f} ms"
          f" (cap {profile.long_prefill_token_threshold or 'none'})")


main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
