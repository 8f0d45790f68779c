"""sim31: the mixed colocated 0.25 cliff, step by step. For each set named: the 46-token chat's measured TTFT and
the recorded engine steps around it (wall s, thread CPU s, new:context tokens per sequence, start), then, given a
calibrated profile, the simulated admissions and step starts around it (ms from the chat's send).
usage: PYTHONPATH=. python bench/validation/sim31/cliff_steps.py SET [CALIBRATED_PROFILE]
  e.g. quiet21 /tmp/bench_validation_sim31_front_cpu_quiet21_cal.json (all_sets.sh's, O=bench/validation/sim31/front_cpu)"""
import glob
import json
import sys

from bench.simulate import node_steps
from bench.simulate.validate import point_requests, ranked_before, topology
from pdplan import sim_engine
from pdplan.profile import Profile
from pdplan.simulation import SLOTargets, simulate

CHAT = 46           # the chat's prompt tokens
WINDOW_S = (-0.08, 0.06)


def measured(point: dict) -> None:
    chat = next(r for r in point["requests"] if r["prompt_len"] == CHAT)
    print(f"measured: chat TTFT {chat['ttft_ms']:.0f} ms; the steps from chat 107's prefill to the chat's:")
    steps = point["steps"]["colocated-0"]
    first = next(i for i, s in enumerate(steps) if " 107:0 " in f" {s} ")
    last = next(i for i, s in enumerate(steps) if f" {CHAT}:0 " in f" {s} ")
    for s in steps[first:last + 1]:
        print("  ", s)


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
