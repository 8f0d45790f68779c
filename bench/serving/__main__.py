"""python -m bench.serving: the serving benchmark's command line.

    python -m bench.serving install                  # vLLM CPU venv + `openai` for transformers serve (once)
    python -m bench.serving compare --quick          # all systems, alpaca, 2 rates: a few minutes
    python -m bench.serving compare                  # all systems, sharegpt rate sweep: ~30-40 minutes
    python -m bench.serving compare --workload mixed --rates 0.5,1 --systems pdserve-1p1d,pdserve-colocated
    python -m bench.serving tune                     # pdserve prefill knobs on the RAG workload
    python -m bench.serving tune --routing           # pdserve-1p1d routing knobs: the best for the TTFT SLO
    python -m bench.serving plot bench/results/serving_compare_*.json
    python -m bench.serving workloads                # the workloads' length statistics
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from bench.serving.metrics import SLO
from bench.serving.servers import SYSTEMS, Knobs, known
from bench.serving.workloads import WORKLOADS

QUICK = dict(workload="alpaca", num_requests=12, rates="1,4", deadline_s=90.0)
FULL = dict(workload="sharegpt", num_requests=24, rates="0.25,0.5,1,2", deadline_s=180.0)
TUNE_GRID = "256x64,512x64,1024x64,2048x64,4096x64,1024x8,4096x8"


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # servers stop
    args.func(args)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    sub.add_parser("install", help="install the peers (vLLM CPU, transformers serve's extras)").set_defaults(func=_install)
    c = sub.add_parser("compare", help="side-by-side rate sweep")
    _sweep_args(c, systems=",".join(SYSTEMS))
    c.add_argument("--quick", action="store_true", help=f"defaults {QUICK}")
    c.set_defaults(func=_compare)
    t = sub.add_parser("tune", help="prefill knobs against TTFT on one system")
    _sweep_args(t, systems="pdserve-colocated")
    t.add_argument("--grid", default=TUNE_GRID, help="TOKENSxSEQS pairs (max_num_batched_tokens x max_num_seqs)")
    t.add_argument("--routing", action="store_true", help="tune pdserve-1p1d's routing knobs instead: every "
                   "combination of the three lists below")
    t.add_argument("--local-prefill-tokens", default="0,64,256,1024", help="routing: thresholds to try")
    t.add_argument("--decode-load-weights", default="0.25,1", help="routing: decode load weights to try")
    t.add_argument("--chunk-sizes", default="2048", help="routing: max_num_batched_tokens values to try")
    t.set_defaults(func=_tune, workload="rag", num_requests=16, rates="0.5", deadline_s=240.0)
    p = sub.add_parser("plot", help="redraw the plots of a result JSON")
    p.add_argument("result")
    p.set_defaults(func=_plot)
    w = sub.add_parser("workloads", help="print each workload's length statistics")
    w.add_argument("--num-requests", type=int, default=1000)
    w.set_defaults(func=_workloads)
    return ap


def _sweep_args(ap: argparse.ArgumentParser, systems: str) -> None:
    ap.add_argument("--systems", default=systems, help=f"comma-separated, of {', '.join(SYSTEMS)}, "
                    "pdserve-1p1d-affinity (the old routing), pdserve-1p1d@T (routing cost, local prefill "
                    "threshold T tokens)")
    ap.add_argument("--repeat", type=int, default=1, help="run the system list this many times, alternating")
    ap.add_argument("--workload", choices=WORKLOADS)
    ap.add_argument("--num-requests", type=int, help="per rate point")
    ap.add_argument("--rates", help="offered request rates, comma-separated (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, help="per rate point")
    ap.add_argument("--output-cap", type=int)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--dtype", default=Knobs().dtype, choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-gib", type=float, default=Knobs().kv_cache_gib)
    ap.add_argument("--max-num-seqs", type=int, default=Knobs().max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=Knobs().max_num_batched_tokens)
    ap.add_argument("--max-model-len", type=int, default=Knobs().max_model_len,
                    help="also scales the RAG documents and long prompts (workloads.rag_document_lengths)")
    ap.add_argument("--pdserve-flags", default="", help='extra flags for both pdserve servers, e.g. '
                    '"--heartbeat-timeout-s 10"')
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy requests; else every request samples at it (no top-k / top-p)")
    ap.add_argument("--no-publish", action="store_true", help="do not copy plots to bench/plots/")


def _spec(args, defaults: dict):
    from bench.serving.compare import SweepSpec
    pick = lambda key: getattr(args, key, None) if getattr(args, key, None) is not None else defaults[key]  # noqa: E731
    return SweepSpec(
        systems=tuple(args.systems.split(",")), workload=pick("workload"), num_requests=pick("num_requests"),
        rates=tuple(float(r) for r in str(pick("rates")).split(",")), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, deadline_s=pick("deadline_s"),
        output_cap=args.output_cap, slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        knobs=Knobs(args.dtype, args.kv_cache_gib, args.max_num_seqs, args.max_num_batched_tokens,
                    args.max_model_len),
        pdserve_flags=tuple(args.pdserve_flags.split()), temperature=args.temperature, repeat=args.repeat)


def _model():
    from bench.serving.model import prepare_model, word_vocab
    from bench.serving.servers import BENCH
    return prepare_model(os.path.join(BENCH, ".cache")), word_vocab()


def _compare(args) -> None:
    from bench.serving.compare import run_sweep
    for name in args.systems.split(","):
        if not known(name):
            raise SystemExit(f"unknown system {name!r}; one of {', '.join(SYSTEMS)}")
    spec = _spec(args, QUICK if args.quick else FULL)
    model, vocab = _model()
    path = run_sweep(spec, model, vocab)
    _report_compare(path, not args.no_publish)


def _report_compare(path: str, publish: bool) -> None:
    from bench.serving import plots, report
    with open(path) as f:
        result = json.load(f)
    stem = os.path.splitext(os.path.abspath(path))[0]
    made = plots.plot_compare(result, stem, publish)
    print("\n" + report.compare_markdown(result))
    print(f"\nwrote {path}\n" + "\n".join(f"      {p}" for p in made))


def _tune(args) -> None:
    from bench.serving import plots, record, report
    from bench.serving.tune import run_tuning
    defaults = dict(workload=args.workload, num_requests=args.num_requests, rates=args.rates,
                    deadline_s=args.deadline_s)
    spec = _spec(args, defaults)
    if args.routing:
        return _tune_routing(args, spec)
    grid = [tuple(int(x) for x in pair.split("x")) for pair in args.grid.split(",")]
    model, vocab = _model()
    result = run_tuning(spec.systems[0], spec, grid, model, vocab)
    path = record.write(result, f"serving_tuning_{spec.systems[0]}_{spec.workload}")
    png = plots.plot_tuning(result, os.path.splitext(path)[0], not args.no_publish)
    print("\n" + report.tuning_table(result) + f"\n\nwrote {path}\n      {png}")


def _tune_routing(args, spec) -> None:
    from bench.serving import record, report
    from bench.serving.tune import ROUTED, routing_grid, run_routing_tuning
    numbers = lambda text, kind: [kind(x) for x in text.split(",")]    # noqa: E731
    grid = routing_grid(numbers(args.local_prefill_tokens, int), numbers(args.decode_load_weights, float),
                        numbers(args.chunk_sizes, int))
    model, vocab = _model()
    result = run_routing_tuning(spec, grid, model, vocab)
    path = record.write(result, f"serving_routing_tuning_{ROUTED}_{spec.workload}")
    print("\n" + report.routing_tuning_table(result) + f"\n\nwrote {path}")


def _plot(args) -> None:
    with open(args.result) as f:
        result = json.load(f)
    if result["bench"] == "serving_routing_tuning":
        from bench.serving import report
        print(report.routing_tuning_table(result))
    elif result["bench"] == "serving_tuning":
        from bench.serving import plots, report
        print(plots.plot_tuning(result, os.path.splitext(os.path.abspath(args.result))[0]))
        print(report.tuning_table(result))
    else:
        _report_compare(args.result, True)


def _workloads(args) -> None:
    from bench.serving.workloads import WorkloadSpec, generate, summary
    for name in WORKLOADS:
        print(name, json.dumps(summary(generate(WorkloadSpec(name, args.num_requests)))))


def _install(args) -> None:
    from bench.serving.install import install
    install()


if __name__ == "__main__":
    main(sys.argv[1:])
