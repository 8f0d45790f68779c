"""sim32: the cliff's kind of race in a set's mixed colocated points: each chat sent less than 50 ms before a long
prompt, with its measured TTFT (on the cliff it shares a step with the long prompt's first chunk: 1.6-2.5 s), and
each point's long prompts and slowest chats.
usage: PYTHONPATH=. python bench/validation/sim32/races.py [SET ...]   (default quiet22 quiet23 quiet24)"""
import glob
import json
import sys

WINDOW_MS = 50.0


def main(sets: list[str]) -> None:
    for name in sets:
        for path in glob.glob(f"bench/validation/{name}/simulate_measured_mixed_*.json"):
            for p in json.load(open(path))["systems"]["colocated"]["points"]:
                reqs = p["requests"]
                longs = [r for r in reqs if r["kind"] == "long"]
                near = [(lg["send_ms"] - r["send_ms"], r["prompt_len"], r["ttft_ms"]) for lg in longs for r in reqs
                        if r["kind"] != "long" and 0 < lg["send_ms"] - r["send_ms"] < WINDOW_MS]
                slow = sorted(r["ttft_ms"] for r in reqs if r["kind"] != "long")[-3:]
                print(f"{name} mixed colocated {p['rate']:g}: {len(reqs)} requests, {len(longs)} long prompts; "
                      f"chats sent < {WINDOW_MS:.0f} ms before one: "
                      + (", ".join(f"{ahead:.1f} ms ahead, {n} tokens, TTFT {t:.0f} ms" for ahead, n, t in near) or "none")
                      + f"; slowest chats' TTFT {', '.join(f'{t:.0f}' for t in slow)} ms")


if __name__ == "__main__":
    main(sys.argv[1:] or ["quiet22", "quiet23", "quiet24"])
