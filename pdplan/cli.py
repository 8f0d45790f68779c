"""`pdserve profile` and `pdserve plan`.

    pdserve profile [--model DIR] [node flags] [--out profile.json] [--quick]
    pdserve plan --profile profile.json --workload rag --rate 20 [--slo-ttft-ms 1000] [--slo-tpot-ms 100]
                 [--slo-itl-ms 150]

`profile` measures one engine as a node runs it (the node's flags: --dtype, --block-size,
--kv-cache-gib, --max-num-seqs, --max-num-batched-tokens, ...) on whatever device it uses and
writes the JSON profile (pdplan/profile.py). `plan` searches deployments with the simulator and
prints the recommendation (pdplan/planner.py) and the `pdserve up --autoscale` flags with the same
targets (the autoscaler's ITL target is the ITL SLO, or the TPOT SLO without one). The workloads are the serving benchmark's
(bench/serving/workloads.py), so `plan` runs from a checkout.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Sequence


def profile_main(argv: Sequence[str]) -> None:
    from engine.args import EngineArgs
    from engine.flags import add_dataclass_args, build_dataclass
    from pdplan.profiler import ProfileGrid, Profiler

    ap = argparse.ArgumentParser(prog="pdserve profile", description=__doc__.splitlines()[0])
    add_dataclass_args(ap, EngineArgs)
    ap.add_argument("--out", default="profile.json", help="where the JSON profile goes")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (tests, smoke runs)")
    ap.add_argument("--raw-steps", action="store_true",
                    help="keep each step's time as measured, not priced at one machine speed from the speed "
                         "probes between the experiments (pdplan/speed_sections.py)")
    args = vars(ap.parse_args(argv))
    grid = _quick_grid() if args.pop("quick") else ProfileGrid()
    out, one_speed = args.pop("out"), not args.pop("raw_steps")
    profile = Profiler(build_dataclass(EngineArgs, args), grid, one_speed=one_speed).run()
    profile.save(out)
    step = profile.step
    print(f"wrote {out}: step = {step.fixed * 1e3:.2f} ms + {step.per_token * 1e6:.1f} us/token "
          f"(at least {step.knee_tokens:g} tokens) + "
          f"{step.per_seq * 1e6:.1f} us/seq (at least {step.knee_seqs:g} seqs) + "
          f"{step.per_decode_ctx * 1e9:.1f} ns/decode ctx token + "
          f"{step.per_prefill_pair * 1e9:.2f} ns/prefill pair + "
          f"{step.per_prefill_ctx * 1e9:.1f} ns/prefill ctx token; median fit error {profile.fit_error():.1%}; "
          f"transfer {profile.transfer.per_block_s * 1e6:.0f} us/block")


def plan_main(argv: Sequence[str]) -> None:
    from pdplan.planner import Planner, PlanRequest
    from pdplan.profile import Profile

    ap = argparse.ArgumentParser(prog="pdserve plan", description="recommend pool sizes for SLOs and a rate")
    ap.add_argument("--profile", required=True, help="a JSON profile from `pdserve profile`")
    ap.add_argument("--workload", default="sharegpt", help="sharegpt | rag | mixed | alpaca | prefix")
    ap.add_argument("--rate", type=float, required=True, help="offered requests/s")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="time to first token")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0, help="time per output token: a request's mean gap")
    ap.add_argument("--slo-itl-ms", "--itl-ms", type=float, default=None,
                    help="inter-token latency: the 90th percentile of a request's gaps (default: not a target)")
    ap.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet every SLO")
    ap.add_argument("--num-requests", type=int, default=600, help="simulated requests per candidate")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-nodes", type=int, default=4096)
    ap.add_argument("--warmup-s", type=float, default=0.0,
                    help="arrivals simulated but not scored: plan for the steady state (warm prefix caches)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None,
                    help="plan for nodes run with this cap on a prompt's tokens a step (default: the profile's)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    req = PlanRequest(a.workload, a.rate, a.slo_ttft_ms, a.slo_tpot_ms, a.slo_itl_ms, a.attainment,
                      min_requests=a.num_requests, max_model_len=a.max_model_len, max_nodes=a.max_nodes,
                      warmup_s=a.warmup_s)
    profile = Profile.load(a.profile)
    if a.long_prefill_token_threshold is not None:
        profile = replace(profile, long_prefill_token_threshold=a.long_prefill_token_threshold)
    plan = Planner(profile).plan(req)
    print(json.dumps(plan.to_dict(), indent=1) if a.json else plan.describe())


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    {"profile": profile_main, "plan": plan_main}[argv[0]](argv[1:])


def _quick_grid():
    from pdplan.profiler import ProfileGrid
    return ProfileGrid(prompt_lens=(16, 256), chunk_sizes=(256,), cached_prefixes=(256,), warm_documents=(256,), warm_tails=(16,),
                       warm_repeats=1, batch_sizes=(1, 4),
                       contexts=(32,), decode_steps=2, mixed=((4, 32, 256),),
                      transfer_blocks=8)
