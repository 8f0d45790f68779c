"""sim23: each request of quiet12's 1P+2D points, measured TTFT against simulated (validate --node-speed
kind), with where each was prefilled in the simulation (local: on its decode node) and its decode node
measured / simulated. usage: ttft_by_request.py PROFILE MEASURED..."""
import statistics
import sys

from bench.validation.sim23.points import points
from pdplan import sim_router

LOCAL: set[int] = set()


def watch():
    try_ = sim_router.SimRouter._try

    def _try(self, req, probe=False):
        before = self.local_prefills
        ok = try_(self, req, probe)
        if self.local_prefills > before:
            LOCAL.add(req.rid)
        return ok
    sim_router.SimRouter._try = _try


def main(profile_path, paths):
    watch()
    for pt in points(profile_path, paths):
        LOCAL.clear()
        pt.run()
        print(f"## {pt.label} (measured local prefills {pt.measured.get('local_prefills')})")
        gaps = {True: [], False: []}
        for r, m in zip(pt.reqs, pt.measured["requests"]):
            local = r.rid in LOCAL
            sim_ms = 1e3 * r.ttft if r.token_times else float("nan")
            gaps[local].append(m["ttft_ms"] - sim_ms)
            print(f"  {r.rid:3} {m['kind']:10} prompt {r.prompt_len:5} {'local ' if local else 'remote'} "
                  f"TTFT {m['ttft_ms']:7.0f} / {sim_ms:7.0f} ms  decode {m.get('decode_node', '?')} / {r.decode_node}")
        for local, g in gaps.items():
            if g:
                print(f"  {'local' if local else 'remote'}: {len(g)} requests, median measured - simulated "
                      f"{statistics.median(g):.0f} ms")


main(sys.argv[1], sys.argv[2:])
