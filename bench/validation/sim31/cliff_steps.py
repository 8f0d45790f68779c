"""sim31: the mixed colocated 0.25 cliff, step by step. For each set named: the 46-token chat's measured TTFT and
the recorded engine steps around it (wall s, thread CPU s, new:context tokens per sequence, start), then, given a
calibrated profile, the simulated admissions and step starts around it (ms from the chat's send).
usage: PYTHONPATH=. python bench/validation/sim31/cliff_steps.py SET [CALIBRATED_PROFILE]
  e.g. quiet21 /tmp/bench_validation_sim31_front_cpu_quiet21_cal.json (all_sets.sh's, O=bench/validation/sim31/front_cpu)"""
import glob
import json
import statistics
import sys

from bench.simulate import node_steps
from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan import sim_engine
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate

CHAT = 46           # the chat's prompt tokens
WINDOW_S = (-0.08, 0.06)


def measured(point: dict) -> None:
    """The steps' clock put on the client's: a request prefilled alone in a step of its own gets its
    first token as that step ends (the median over those requests of end - (send + TTFT))."""
    chat = next(r for r in point["requests"] if r["prompt_len"] == CHAT)
    steps = [(float(s.split("@")[1]), float(s.split()[0]), s) for s in point["steps"]["colocated-0"]]
    alone = {s.split()[2]: start + wall for start, wall, s in steps if len(s.split()) == 4}
    offset = statistics.median(alone[f"{r['prompt_len']}:0"] - (r["send_ms"] + r["ttft_ms"]) / 1e3
                               for r in point["requests"] if f"{r['prompt_len']}:0" in alone)
    print(f"measured: chat TTFT {chat['ttft_ms']:.0f} ms; the steps from chat 107's prefill to the chat's "
          f"(start and end, ms from the chat's send; wall, thread CPU ms):")
    first = next(i for i, x in enumerate(steps) if " 107:0 " in f" {x[2]} ")
    last = next(i for i, x in enumerate(steps) if f" {CHAT}:0 " in f" {x[2]} ")
    sent = chat["send_ms"] / 1e3 + offset
    for start, wall, s in steps[first:last + 1]:
        print(f"  {1e3 * (start - sent):+8.1f} .. {1e3 * (start + wall - sent):+8.1f}  {1e3 * wall:7.1f} "
              f"{1e3 * float(s.split()[1]):7.1f}  {' '.join(s.split()[2:]).split(' @')[0]}")


def simulated(profile_path: str, sweep: dict, run: dict, nproc: int) -> None:
    log = []
    add, kick = sim_engine.SimEngine.add, sim_engine.SimEngine.kick

    def traced_add(self, seq):
        log.append((self.loop.now, f"admitted: request {seq.req.rid}, {seq.req.prompt_len} tokens"))
        return add(self, seq)

    def traced_kick(self):
        was = self.stepping
        kick(self)
        if self.stepping and not was:
            log.append((self.loop.now, "step starts"))
    sim_engine.SimEngine.add, sim_engine.SimEngine.kick = traced_add, traced_kick
    profile, point = Profile.load(profile_path), run["points"][0]
    reqs = point_requests(sweep, 0, point["rate"], profile, point.get("requests"))
    simulate(profile, reqs, topology("colocated", run, nproc), SLOTargets(sweep["slo"]["ttft_ms"], sweep["slo"]["tpot_ms"]),
             ranked_before=ranked_before(run, 0), speed=node_steps.speed_map(point.get("steps"), profile.step, "kind"))
    sent = next(r for r in reqs if r.prompt_len == CHAT).arrival
    print(f"simulated: chat TTFT {1e3 * next(r for r in reqs if r.prompt_len == CHAT).ttft:.0f} ms; from its send:")
    for t, what in log:
        if WINDOW_S[0] < t - sent < WINDOW_S[1]:
            print(f"  {1e3 * (t - sent):+8.2f} ms  {what}")


def main() -> None:
    d = json.load(open(glob.glob(f"bench/validation/{sys.argv[1]}/simulate_measured_mixed_*.json")[0]))
    run = d["systems"]["colocated"]
    measured(run["points"][0])
    if len(sys.argv) > 2:
        simulated(sys.argv[2], d["sweep"], run, d["machine"]["nproc"])


if __name__ == "__main__":
    main()
