"""One request's path through a real deployment, timed (the simulator's validation, issue #18):
a measure.py run whose every process records timestamps (trace_points.py), then one row per
request, from the client sending it to the client's first token:

    python -m bench.simulate trace --workload sharegpt --rates 0.5 --systems 1p1d
    python -m bench.simulate trace --analyze bench/results/trace_<stamp>/

    arrive   client sent -> the router's backend has it (HTTP, tokenizing)
    reserve  DecodeRequest out -> Reserved back; d_wait: of that, D was inside a step
    prefill  PrefillRequest out -> P's FirstToken at the router (P's queue, chunk steps, the hop)
    deliver  FirstToken at the router -> the client's first text; first_by: who sent that text
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import time

HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tracehook")
OLD_CLIENT_WARMUP = 2   # the load generator's warm-up requests before a traced point, before measured.json said


def run(spec, model: str, vocab: list[str], system: str, out_dir: str) -> str:
    from bench.serving.servers import REPO
    from bench.simulate import trace_points
    from bench.simulate.measure import measure
    os.makedirs(out_dir, exist_ok=True)
    os.environ["PDSERVE_TRACE_DIR"] = out_dir
    trace_points.install_client()
    result = measure(system, spec, model, vocab, env={"PYTHONPATH": f"{REPO}:{HOOK}"})
    with open(os.path.join(out_dir, "measured.json"), "w") as f:
        json.dump({"system": system, "warmup_requests": result["warmup_requests"],
                   "points": [{k: p[k] for k in ("rate", "metrics", "loadavg_before", "loadavg_after",
                                                 "cpu", "float_cpu", "cpu_wall_s", "core_steal_s")} for p in result["points"]]}, f,
                  default=str)
    return out_dir


def load(out_dir: str) -> list[dict]:
    events = []
    for path in glob.glob(os.path.join(out_dir, "*.jsonl")) + glob.glob(os.path.join(out_dir, "*.jsonl.gz")):
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            events += [json.loads(line) for line in f if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def requests(events: list[dict]) -> list[dict]:
    """One row per client request, in ms, matched to the router's request by time."""
    starts = [e for e in events if e["e"] == "gen_start"]
    clients = sorted((e for e in events if e["e"] == "c_req" and e.get("ttft")), key=lambda e: e["t0"])
    rows, used = [], set()
    for c in clients:                       # each to the first router request after it not yet taken
        g = next((s for s in starts if s["t"] >= c["t0"] and id(s) not in used), None)
        if g is None:
            continue
        used.add(id(g))
        rid = g["rid"]
        mine = [e for e in events if str(e.get("rid") or "").split("#")[0].split("~")[0] == rid]
        first = c["t0"] + c["ttft"]

        def at(p, ev, m=None, cond=lambda e: True):
            return next((e for e in mine if (p is None or e["p"].startswith(p)) and e["e"] == ev
                         and (m is None or e.get("m") == m) and cond(e)), None)
        dreq = at("router", "send", "DecodeRequest")
        drecv = at("decode", "recv", "DecodeRequest")
        rsv = at("router", "recv", "Reserved")
        preq = at("router", "send", "PrefillRequest")
        ftok = at("router", "recv", "FirstToken")
        delta0 = at("router", "recv", "TokenDelta")
        text_y = at("router", "yield", cond=lambda e: e["txt"] > 0)
        row = {"rid": rid, "t": c["t0"], "ttft": c["ttft"] * 1e3, "local": preq is None,
               "arrive": (g["t"] - c["t0"]) * 1e3}
        dsent = at("decode", "send", "Reserved")
        if dsent and drecv and not _batch_at(events, "decode", drecv["t"]):
            row["admitted"] = (dsent["t"] - c["t0"]) * 1e3      # sent -> D has it reserved (D between steps)
        if dreq and rsv:
            row["reserve"] = (rsv["t"] - dreq["t"]) * 1e3
            row["d_wait"] = (drecv["t"] - dreq["t"]) * 1e3 if drecv else None
            row["before_reserve"] = (dreq["t"] - g["t"]) * 1e3
        if preq and ftok:
            row["prefill"] = (ftok["t"] - preq["t"]) * 1e3
            row["ftok_txt"] = ftok.get("txt")
            precv, psend = at("prefill", "recv", "PrefillRequest"), at("prefill", "send", "FirstToken")
            steps = [e for e in events if e["e"] == "step" and e["p"].startswith("prefill")
                     and any(c[0] == rid for c in e["chunks"]) or (e["e"] == "step" and e["p"].startswith("prefill")
                                                                   and rid in e["out"])]
            if precv and psend and steps:
                row["p_recv"] = (precv["t"] - preq["t"]) * 1e3
                row["p_wait"] = (steps[0]["t0"] - precv["t"]) * 1e3
                row["p_steps"] = sum(s["t"] - s["t0"] for s in steps) * 1e3
                row["p_span"] = (steps[-1]["t"] - steps[0]["t0"]) * 1e3
                row["p_tokens"] = sum(c[1] for s in steps for c in s["chunks"] if c[0] == rid)
                row["p_batch"] = max(len(s["chunks"]) for s in steps)
                row["p_back"] = (ftok["t"] - psend["t"]) * 1e3
        if text_y:
            row["deliver"] = (first - text_y["t"]) * 1e3
            row["first_by"] = "P" if ftok and text_y["t"] >= ftok["t"] and (not delta0 or delta0["t"] > text_y["t"]) \
                else "D"
        closed, sent = at("prefill", "ship_close"), at("prefill", "ship_sent")
        if closed and sent:
            row["p_drain"] = (sent["t"] - closed["t"]) * 1e3    # P's loop polls without sleeping meanwhile
        if ftok and delta0:
            row["p_to_d"] = (delta0["t"] - ftok["t"]) * 1e3
        row["d_batch"] = _batch_at(events, "decode", dreq["t"] if dreq else g["t"])
        row["scrape"] = sum(max(0.0, min(first, s["t"]) - max(c["t0"], s["t0"])) for s in events
                            if s["e"] in ("scrape", "render")) * 1e3     # the load generator's /metrics beside it
        row["client_gc"] = sum(max(0.0, min(first, s["t"]) - max(c["t0"], s["t0"])) for s in events
                               if s["e"] == "gc") * 1e3        # the load generator's collector stopped it
        rows.append(row)
    return rows


def _batch_at(events: list[dict], node: str, t: float) -> int:
    """Sequences in the node's step running at t (0 if it was between steps)."""
    for e in events:
        if e["e"] == "step" and e["p"].startswith(node) and e["t0"] <= t <= e["t"]:
            return e["seqs"]
    return 0


def table(rows: list[dict]) -> str:
    keys = ("ttft", "local", "arrive", "before_reserve", "reserve", "d_wait", "prefill", "p_recv", "p_wait", "p_steps",
            "p_span", "p_tokens", "p_batch", "p_back", "p_drain", "ftok_txt", "p_to_d", "deliver", "first_by", "d_batch", "scrape", "client_gc")
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def analyze(out_dir: str, profile_path: str | None = None) -> str:
    events = load(out_dir)
    rows = requests(events)
    text = table(rows)
    if profile_path:
        from pdplan.profile import Profile
        profile = Profile.load(profile_path)
        text += "\n\n" + overlap_table(step_ratios(events, profile)) + "\n\n" + prefill_step_table(events, profile)
        text += "\n\n" + shared_core_table(events, profile)
        from bench.simulate.bus_cost import point_factor
        beside = point_factor(out_dir, profile)
        if beside:
            text += f"\n\na decode step's CPU / price beside a prefill step over alone: {beside.factor:.3f} " \
                    f"({beside.beside} / {beside.alone} steps; bus_cost.py)"
    measured = os.path.join(out_dir, "measured.json")
    if os.path.exists(measured):
        with open(measured) as f:
            for p in json.load(f)["points"]:
                tokens = p["metrics"]["total_output_tokens"] if "total_output_tokens" in p["metrics"] else None
                text += f"\n\nrate {p['rate']}: load {p['loadavg_before']}, nodes {p['cpu']}, " \
                        f"unpinned {p.get('float_cpu')}, output tokens {tokens}"
    remote = [r for r in rows if not r["local"]]
    if remote:
        text += f"\n\nremote prefills: TTFT p50 {statistics.median(r['ttft'] for r in remote):.1f} ms"
    print(text)
    return text


def front_end(out_dirs: list[str]) -> tuple[float, float]:
    """(seconds, seconds per prompt token): the client's send -> the router's backend has the request
    (HTTP, the body, tokenizing), over the traced requests of `out_dirs` (trace_<workload>_<system>_<rate>_<stamp>,
    whose prompts are regenerated from the workload, seeds as `trace` ran them)."""
    return thirds_line([(n, r["arrive"] / 1e3) for n, r in _by_prompt(out_dirs)])


def front_cpu(out_dirs: list[str]) -> tuple[float, float]:
    """(seconds, seconds per prompt token): the CPU of the front end's work on a request's prompt
    (the HTTP worker's tokenizing call, traced `work`), over every such call of `out_dirs`: what a
    colocated server's front end takes from its engine's core (pdplan/colocated.py). Traces made
    before those calls were traced (trace3, trace4) have none: (0, 0), the front end all time."""
    calls = [(e["tokens"], e["cpu"]) for d in out_dirs for e in load(d) if e["e"] == "work" and "tokens" in e]
    return thirds_line(calls) if len(calls) >= 3 else (0.0, 0.0)


def admission(out_dirs: list[str]) -> tuple[float, float]:
    """(seconds, seconds per prompt token): a disaggregated router's backend has the request -> the
    decode node has reserved its blocks (the router's hashing and ranking, DecodeRequest with every
    prompt token to D, D's own hashing and prefix match, its Reserved), over the traced requests
    that found D between steps (the wait for D's step is simulated apart: SimEngine.between_steps)."""
    return thirds_line([(n, (r["admitted"] - r["arrive"]) / 1e3) for n, r in _by_prompt(out_dirs) if "admitted" in r])


def _by_prompt(out_dirs: list[str]) -> list[tuple[int, dict]]:
    """(prompt tokens, row) of every traced request of `out_dirs`, the warm-up's left out."""
    from pdplan.workload import sim_requests
    pts = []
    for d in out_dirs:
        workload, _, rate = os.path.basename(os.path.normpath(d)).split("_")[1:4]
        rows = sorted(requests(load(d)), key=lambda r: r["t"])[warmup_requests(d):]     # the point's own
        reqs = sorted(sim_requests(workload, len(rows), float(rate), 0, 16, 4096, output_cap=256), key=lambda r: r.arrival)
        pts += [(q.prompt_len, r) for r, q in zip(rows, reqs)]
    return pts


def warmup_requests(out_dir: str) -> int:
    """The load generator's warm-up requests before a traced point (its measured.json; 2 before
    measure.py recorded them, compare._warmup's)."""
    try:
        with open(os.path.join(out_dir, "measured.json")) as f:
            return json.load(f).get("warmup_requests", OLD_CLIENT_WARMUP)
    except FileNotFoundError:
        return OLD_CLIENT_WARMUP


def thirds_line(pts: list[tuple[int, float]]) -> tuple[float, float]:
    """Robust to a few requests a busy process took late: the line through the medians of the
    shortest and the longest third of the prompts (a slope below 0 is 0)."""
    pts = sorted(pts)
    short, long = pts[:len(pts) // 3], pts[-(len(pts) // 3):]
    (x0, y0), (x1, y1) = [(statistics.median(p[0] for p in h), statistics.median(p[1] for p in h)) for h in (short, long)]
    slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
    return y0 - slope * x0, slope


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def step_ratios(events: list[dict], profile) -> dict[str, list[tuple[float, float, float]]]:
    """Per node: (overlap, measured / profile, measured ms) for each step, overlap being the share
    of the step's wall time during which another node was inside a step of its own (on another
    core: the two share the machine's memory bandwidth and caches, not a core)."""
    steps: dict[str, list[dict]] = {}
    for e in events:
        if e["e"] == "step" and e.get("shapes"):
            steps.setdefault(e["p"], []).append(e)
    out = {}
    for node, mine in steps.items():
        others = [s for n, ss in steps.items() if n != node for s in ss]
        rows = []
        for s in mine:
            dur = s["t"] - s["t0"]
            busy = sum(max(0.0, min(s["t"], o["t"]) - max(s["t0"], o["t0"])) for o in others)
            pred = profile.step.of([tuple(x) for x in s["shapes"]])
            rows.append((min(1.0, busy / dur) if dur > 0 else 0.0, dur / pred, dur * 1e3))
        out[node] = rows
    return out


def prefill_step_table(events: list[dict], profile) -> str:
    """Each prefill-node step: wall and own CPU time (thread_time), the profile's price, and the share
    of it during which the decode node was inside a step of its own."""
    decode = [e for e in events if e["e"] == "step" and e["p"].startswith("decode")]
    lines = ["| prefill step (new tokens, context) | wall ms | CPU ms | profile ms | decode node stepping |",
             "|---|---|---|---|---|"]
    for e in events:
        if e["e"] == "step" and e["p"].startswith("prefill") and e.get("shapes") and "cpu" in e:
            wall = e["t"] - e["t0"]
            beside = sum(max(0.0, min(e["t"], o["t"]) - max(e["t0"], o["t0"])) for o in decode) / wall
            lines.append(f"| {e['shapes']} | {wall * 1e3:.1f} | {e['cpu'] * 1e3:.1f} | "
                         f"{profile.step.of([tuple(x) for x in e['shapes']]) * 1e3:.1f} | {beside:.0%} |")
    return "\n".join(lines)


def overlap_table(ratios: dict[str, list[tuple[float, float, float]]]) -> str:
    """Median measured / profile by overlap: alone (< 10%), partly, mostly (> 90%) beside a step."""
    lines = ["| node | alone: steps, measured / profile | partly | beside another step (> 90%) |", "|---|---|---|---|"]
    for node, rows in sorted(ratios.items()):
        cells = []
        for lo, hi in ((0.0, 0.1), (0.1, 0.9), (0.9, 1.01)):
            r = [x[1] for x in rows if lo <= x[0] < hi]
            cells.append(f"{len(r)}, {statistics.median(r):.2f}" if r else "0")
        lines.append(f"| {node} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shared_core_table(events: list[dict], profile) -> str:
    """The decode nodes that share a core (1P+2D here): each step's wall and own CPU time (thread_time)
    against the profile, by the share of it during which another decode node was inside a step
    (processor sharing: wall / CPU 1 alone, 2 beside), and the run's time with 0, 1 and 2 of them
    inside a step. Empty with fewer than two decode nodes."""
    steps: dict[str, list[dict]] = {}
    for e in events:
        if e["e"] == "step" and e["p"].startswith("decode") and e.get("shapes") and "cpu" in e:
            steps.setdefault(e["p"], []).append(e)
    if len(steps) < 2:
        return ""
    lines = ["| decode node | steps | CPU / profile | wall / CPU: alone (< 10%) | partly | beside (> 90%) | mean gap between steps ms |",
             "|---|---|---|---|---|---|---|"]
    for node, mine in sorted(steps.items()):
        others = [s for n, ss in steps.items() if n != node for s in ss]
        rows = []
        for s in mine:
            wall = s["t"] - s["t0"]
            beside = sum(max(0.0, min(s["t"], o["t"]) - max(s["t0"], o["t0"])) for o in others) / wall if wall > 0 else 0.0
            rows.append((beside, wall / max(s["cpu"], 1e-9)))
        cpu = sum(s["cpu"] for s in mine) / sum(profile.step.of([tuple(x) for x in s["shapes"]]) for s in mine)
        cells = []
        for lo, hi in ((0.0, 0.1), (0.1, 0.9), (0.9, 1.01)):
            r = [x[1] for x in rows if lo <= x[0] < hi]
            cells.append(f"{statistics.median(r):.2f} ({len(r)})" if r else "-")
        gaps = [b["t0"] - a["t"] for a, b in zip(mine, mine[1:]) if b["t0"] - a["t"] < 0.05]
        lines.append(f"| {node} | {len(mine)} | {cpu:.2f} | " + " | ".join(cells) + f" | {_cell(statistics.mean(gaps) * 1e3 if gaps else None)} |")
    span = inside_spans([s for ss in steps.values() for s in ss])
    return "\n".join(lines) + f"\n\ndecode nodes inside a step: none {span[0]:.1f} s, one {span[1]:.1f} s, both {span[2]:.1f} s"


def inside_spans(steps: list[dict]) -> list[float]:
    """Seconds, from the first step's start to the last one's end, during which none, one, and two or
    more of `steps` (t0 to t) ran."""
    edges = sorted([(s["t0"], 1) for s in steps] + [(s["t"], -1) for s in steps])
    inside, last, span = 0, edges[0][0], [0.0, 0.0, 0.0]
    for t, d in edges:
        span[min(inside, 2)] += t - last
        inside, last = inside + d, t
    return span
