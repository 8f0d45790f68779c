"""python -m bench.simulate: the simulator's validation against real runs, and the on-paper study.

    python -m bench.simulate measure --workload rag --rates 0.5,1     # real runs, pinned (minutes)
    python -m bench.simulate pool run1.json run2.json --out P.json          # several profile runs, one fit
    python -m bench.simulate pool new.json old.json --only prefill_warm --out P.json   # old's, plus new's warm steps
    python -m bench.simulate pool A.json B.json --agree 0.05 --out P.json   # two made back to back: pooled only if they agree
    python -m bench.simulate calibrate bench/results/simulate_measured_sharegpt_*.json --profile P.json --out C.json
        [--front-from TRACES...] [--loop-from COLOCATED_TRACE DECODE_TRACE ...] [--beside-from TRACES...]
        [--node-speed kind]
    python -m bench.simulate validate bench/validation/*.json --profile C.json [--contention] [--jitter 10] [--speed]
        [--probe-speed] [--node-speed [cpu|wall|kind]]
    python -m bench.simulate repeat bench/validation/quiet3/simulate_measured_rag_*.json --profile C.json
    python -m bench.simulate study --profile P.json [--gpu-profile G.json]   # 10..1000 req/s on paper
    python -m bench.simulate gpu-profile --out bench/profiles/gpu_published.json
    python -m bench.simulate trace --workload sharegpt --rates 0.25,0.5 --systems 1p1d  # one request's path, timed
"""
from __future__ import annotations

import argparse
import sys

SYSTEMS = "colocated,1p1d,1p2d"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    m = sub.add_parser("measure", help="real runs, nodes pinned to cores")
    m.add_argument("--workload", default="sharegpt")
    m.add_argument("--systems", default=SYSTEMS)
    m.add_argument("--rates", default="0.5,1")
    m.add_argument("--num-requests", type=int, default=16)
    m.add_argument("--output-cap", type=int, default=256)
    m.add_argument("--deadline-s", type=float, default=150.0)
    m.add_argument("--pdserve-flags", default="", help="extra flags for the pdserve servers, e.g. "
                   "'--long-prefill-token-threshold 256' (validate simulates the ones it models)")
    m.set_defaults(func=_measure)
    v = sub.add_parser("validate", help="simulate the measured points; print the side-by-side table")
    v.add_argument("measured", nargs="+")
    v.add_argument("--profile", required=True)
    v.add_argument("--contention", action="store_true",
                   help="also simulate each point under its measured load, fitted per core (contention.py)")
    v.add_argument("--replay-placement", action="store_true",
                   help="decode each request on the node the measured run's router chose (recorded by measure)")
    v.add_argument("--jitter", type=int, default=0, metavar="RUNS",
                   help="also simulate each point RUNS times with its requests sent up to 0.5 ms late and its steps priced "
                        "up to 1%% off: each error's range, and 'maybe' where every figure's range reaches the 20%% band "
                        "(sensitivity.py); with --node-speed, the node-priced figures' too")
    v.add_argument("--speed", action="store_true",
                   help="also simulate each colocated point with its steps priced at the run's measured CPU / simulated "
                        "busy (how fast its engine ran: a diagnostic that reads the run it predicts)")
    v.add_argument("--probe-speed", action="store_true",
                   help="also simulate each point with its steps priced at the machine's speed then against the "
                        "profile's, as the speed probe saw both (measure and profile record it: pdplan/speed_probe.py); "
                        "the raw errors stay beside it")
    v.add_argument("--node-speed", nargs="?", const="cpu", default="", choices=("cpu", "wall", "kind"),
                   help="also simulate each point whose nodes' steps measure recorded (node_steps.py) with each node's "
                        "steps priced at the median of its measured / priced ratios: their thread CPU (cpu, the default) "
                        "or their wall time (wall: also the core's other work); a node with fewer than "
                        "node_steps.MIN_STEPS steps takes the median over all the point's steps (fewer in all: 1.0); "
                        "kind: thread CPU, a step's decoding rows at the node's decode-only steps' factor and its prompt "
                        "rows at the point's prompt steps' (pdplan/kind_cost.py)")
    v.set_defaults(func=_validate)
    rp = sub.add_parser("repeat", help="warm RAG questions measured on every system: simulated against the lowest")
    rp.add_argument("measured", nargs="+")
    rp.add_argument("--profile", required=True)
    rp.set_defaults(func=_repeat)
    r = sub.add_parser("pool", help="one profile from several runs' steps (refitted): runs priced at one speed each "
                                       "(pdserve profile) repriced at their mean speed, else their probes averaged (with "
                                       "--only: the last run's); the last run's other fields")
    r.add_argument("profiles", nargs="+")
    r.add_argument("--out", required=True)
    r.add_argument("--only", default="", help="comma-separated step kinds (e.g. prefill_warm): take only these "
                                               "from the runs before the last (the last run's steps all)")
    r.add_argument("--agree", type=float, metavar="TOLERANCE",
                   help="two profiles made back to back: compare them (agreement.py) and write the pooled one only if "
                        "every step kind, feature and the transfer agree within TOLERANCE (e.g. 0.05); else exit 1")
    r.set_defaults(func=_pool)
    c = sub.add_parser("calibrate", help="fit the profile's serving overheads to measured runs; writes a new profile")
    c.add_argument("measured", nargs="+")
    c.add_argument("--profile", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--float-from", nargs="*", default=[],
                   help="measured files (or a trace's measured.json) whose float_cpu gives the router's and the "
                        "client's CPU per token, when the calibrated runs did not record it")
    c.add_argument("--front-from", nargs="*", default=[],
                   help="trace folders (python -m bench.simulate trace) whose requests' arrival at the router "
                        "and reservation on the decode node give the front end's and a disaggregated router's "
                        "cost per prompt token, and whose tokenizing calls its CPU per prompt token (trace.py "
                        "front_end, admission, front_cpu); default: none")
    c.add_argument("--loop-from", nargs=2, action="append", default=[], metavar=("COLOCATED", "DECODE"),
                   help="a colocated trace folder and a disaggregated one made under the same conditions (repeatable): "
                        "what the colocated server's loop costs its engine beyond a decode node's (loop_cost.py)")
    c.add_argument("--beside-from", nargs="*", default=[],
                   help="disaggregated trace folders: a decode step's CPU beside the prefill node's step over alone "
                        "(bus_cost.py), the price multiplier of a step while another core of the machine prefills "
                        "(pdplan/sim_bus.py; default 1: none)")
    c.add_argument("--node-speed", nargs="?", const="cpu", default="", choices=("cpu", "wall", "kind"),
                   help="fit with each node priced at its recorded steps' speed, as validate --node-speed "
                        "predicts (calibrate.py); default: the profile's prices")
    c.set_defaults(func=_calibrate)
    s = sub.add_parser("study", help="goodput per node, colocated vs the planner's split, 10-1000 req/s")
    s.add_argument("--profile", action="append", required=True, help="repeatable: CPU, GPU, ...")
    s.add_argument("--rates", default="10,30,100,300,1000")
    s.add_argument("--workloads", default="rag,mixed")
    s.add_argument("--num-requests", type=int, default=1500, help="most simulated requests per candidate")
    s.add_argument("--slo-ttft-ms", type=float, help="default: per profile kind (bench/simulate/study.py SLOS)")
    s.add_argument("--slo-tpot-ms", type=float)
    s.add_argument("--tag", default="", help="added to the result's and the plots' names")
    s.add_argument("--warmup-s", type=float, default=10.0, help="arrivals run but not scored (steady state)")
    s.set_defaults(func=_study)
    pl = sub.add_parser("plot", help="redraw a study's plots and print its table")
    pl.add_argument("result")
    pl.set_defaults(func=_plot)
    g = sub.add_parser("gpu-profile", help="write the GPU profile built from published figures")
    g.add_argument("--out", default="bench/profiles/gpu_a100_llama2_7b_published.json")
    g.set_defaults(func=_gpu_profile)
    t = sub.add_parser("trace", help="a measure run with every process timestamping each request's path (trace.py)")
    t.add_argument("--workload", default="sharegpt")
    t.add_argument("--systems", default="1p1d")
    t.add_argument("--rates", default="0.25,0.5")
    t.add_argument("--num-requests", type=int, default=12)
    t.add_argument("--output-cap", type=int, default=256)
    t.add_argument("--analyze", help="only print the table of an earlier trace folder")
    t.add_argument("--profile", default="bench/profiles/cpu_1core_llama58m_quiet2.json",
                   help="prices each traced step (measured / profile, alone and beside another node's step)")
    t.set_defaults(func=_trace)
    args = ap.parse_args(argv)
    args.func(args)


def _measure(args) -> None:
    from bench.serving import record as rec
    from bench.serving.compare import SweepSpec
    from bench.serving.model import prepare_model, word_vocab
    from bench.serving.servers import BENCH
    from bench.simulate.measure import measure
    import os
    spec = SweepSpec(systems=tuple(args.systems.split(",")), workload=args.workload,
                     num_requests=args.num_requests, rates=tuple(float(r) for r in args.rates.split(",")),
                     deadline_s=args.deadline_s, output_cap=args.output_cap,
                     pdserve_flags=tuple(args.pdserve_flags.split()))
    model, vocab = prepare_model(os.path.join(BENCH, ".cache")), word_vocab()
    result = rec.header("simulate_measured", model) | {"sweep": spec, "systems": {}}
    path = None
    for system in spec.systems:
        result["systems"][system] = measure(system, spec, model, vocab)
        if path:
            os.remove(path)
        path = rec.write(result, f"simulate_measured_{args.workload}")
    print(f"wrote {path}")


def _trace(args) -> None:
    import os
    from bench.serving import record as rec
    from bench.serving.compare import SweepSpec
    from bench.serving.model import prepare_model, word_vocab
    from bench.serving.servers import BENCH
    from bench.simulate import trace
    if args.analyze:
        trace.analyze(args.analyze, args.profile)
        return
    model, vocab = prepare_model(os.path.join(BENCH, ".cache")), word_vocab()
    for system in args.systems.split(","):
        for rate in args.rates.split(","):
            spec = SweepSpec(systems=(system,), workload=args.workload, num_requests=args.num_requests,
                             rates=(float(rate),), output_cap=args.output_cap)
            out = os.path.join(rec.RESULTS, f"trace_{args.workload}_{system}_{rate}_{trace.stamp()}")
            trace.run(spec, model, vocab, system, out)
            print(f"\n[{system} @ {rate} req/s] {out}, load average {os.getloadavg()}")
            trace.analyze(out, args.profile)


def _validate(args) -> None:
    from bench.simulate.validate import validate
    validate(args.measured, args.profile, args.contention, args.replay_placement, args.jitter, args.speed,
             args.probe_speed, args.node_speed)


def _repeat(args) -> None:
    from bench.simulate.repeat import repeat
    repeat(args.measured, args.profile)


def _pool(args) -> None:
    from dataclasses import replace
    from bench.simulate.probe_price import one_speed_runs, pooled_speed
    from pdplan.profile import Profile, StepCost
    runs = [Profile.load(p) for p in args.profiles]
    if args.agree is not None:
        from bench.simulate.agreement import compare
        if len(runs) != 2 or args.only:
            raise SystemExit("--agree compares exactly two whole profiles (no --only)")
        ok, report = compare(*runs, args.agree)
        print(report)
        if not ok:
            raise SystemExit(f"not written: {args.out} (make both profiles again)")
    kinds = set(filter(None, args.only.split(",")))
    try:
        priced = one_speed_runs(runs, last_only=bool(kinds))
    except ValueError as e:
        raise SystemExit(f"not written: {args.out}: {e}")
    steps = priced[0] if priced else [run.samples for run in runs]
    samples = [s for run in steps[:-1] for s in run if not kinds or s.kind in kinds] + steps[-1]
    machine = runs[-1].machine | {"pooled_runs": len(runs)}
    speed = priced[1] if priced else pooled_speed([run.machine for run in runs] if not kinds else [runs[-1].machine])
    machine = {k: v for k, v in machine.items() if k != "speed"} | ({"speed": speed} if speed else {})
    pooled = replace(runs[-1], step=StepCost.fit(samples), samples=samples, machine=machine)
    pooled.save(args.out)
    print(f"wrote {args.out}: {pooled.step}; median fit error {pooled.fit_error():.1%}")


def _calibrate(args) -> None:
    from bench.simulate.calibrate import calibrate
    from pdplan.profile import Profile
    from bench.simulate.loop_cost import colocated_extra
    from pdplan.profile import Overheads
    from bench.simulate.trace import admission, front_cpu, front_end
    per_token = front_end(args.front_from)[1] if args.front_from else 0.0
    cpu_token = min(per_token, front_cpu(args.front_from)[1]) if args.front_from else 0.0
    admit = admission(args.front_from)[1] if args.front_from else 0.0
    loop = colocated_extra([c for c, _ in args.loop_from], [d for _, d in args.loop_from]) if args.loop_from else (0.0, 0.0, 0.0)
    beside = _beside(args.beside_from, Profile.load(args.profile)) if args.beside_from else 1.0
    traced = Overheads(prompt_token_s=per_token, front_cpu_token_s=cpu_token, admit_token_s=admit,
                       colocated_step_s=loop[0], colocated_admit_s=loop[1], colocated_admit_token_s=loop[2],
                       beside_prefill=beside)
    profile = calibrate(args.measured, Profile.load(args.profile), args.float_from, traced,
                        node_speed=args.node_speed)
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.overheads}")


def _beside(out_dirs: list[str], profile) -> float:
    from bench.simulate.bus_cost import beside_prefill
    factor, points = beside_prefill(out_dirs, profile)
    for f in points:
        print(f"{f.out_dir}: a decode step beside a prefill step {f.factor:.3f}x alone ({f.beside} / {f.alone} steps)")
    print(f"beside_prefill {factor:.3f} (the median of {len(points)} points, at least 1)")
    return factor


def _study(args) -> None:
    from bench.simulate.study import study
    slo = (args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms and args.slo_tpot_ms else None
    study(args.profile, [float(r) for r in args.rates.split(",")], args.workloads.split(","), args.num_requests,
          slo, args.tag, args.warmup_s)


def _plot(args) -> None:
    import json
    from bench.simulate.plots import plot_study
    from bench.simulate.study import table
    with open(args.result) as f:
        result = json.load(f)
    print(table(result))
    for png in plot_study(result):
        print(f"plot {png}")


def _gpu_profile(args) -> None:
    from bench.simulate.gpu_profile import published_profile
    published_profile().save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
