"""This tree's C kernels against another git revision's, inside one engine: whole runs of
engine_throughput.py's workload (bench/gemm_ab.py's: 32 requests, 128 prompt / 128 output tokens,
greedy), the two builds taking turns run by run in one process (which goes first alternating),
each run's prefill and decode steps timed apart, after one warm-up run.

    python bench/kernel_ab.py --base HEAD~1 --kernels gemm_bf16 [--dtype bfloat16] [--repeats 6]

The base revision's kernels/csrc is compiled with this tree's flags into a temporary directory;
the named kernels' libraries are swapped between runs (kernels.cpu_kernels' loaders re-read), all
others are this tree's on both sides. The base's functions must have this tree's signatures.
Writes bench/results/kernel_ab_<time>.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, TypeVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout first
from bench.gemm_ab import HERE, engine, timed_run  # noqa: E402  (sets OMP_WAIT_POLICY before torch loads)
from bench.machine import write_result  # noqa: E402
from bench.random_model import make_random_llama  # noqa: E402
from kernels import cpu_kernels  # noqa: E402

T = TypeVar("T")
LOADERS = [cpu_kernels.paged_decode_lib, cpu_kernels.paged_prefill_lib, cpu_kernels.layer_ops_lib,
           cpu_kernels.gemm_bf16_lib, cpu_kernels.gemm_f32_lib, cpu_kernels.argmax_lib]


def build_base(rev: str, names: list[str], out_dir: str) -> dict[str, ctypes.CDLL]:
    """The named kernels of revision rev, built with this tree's flags and typed with its signatures."""
    root = os.path.dirname(HERE)
    src = os.path.join(out_dir, "csrc")
    os.makedirs(src)
    listing = subprocess.run(["git", "-C", root, "ls-tree", "--name-only", f"{rev}:kernels/csrc"], check=True,
                             capture_output=True, text=True, timeout=60).stdout.split()
    for name in listing:
        blob = subprocess.run(["git", "-C", root, "show", f"{rev}:kernels/csrc/{name}"], check=True,
                              capture_output=True, timeout=60).stdout
        with open(os.path.join(src, name), "wb") as f:
            f.write(blob)
    libs = {}
    for name in names:
        so = os.path.join(out_dir, f"{name}.so")
        flags = cpu_kernels._FLAGS + cpu_kernels._EXTRA_FLAGS.get(name, [])
        subprocess.run(["cc", *flags, "-o", so, os.path.join(src, name + ".c"), "-lm"], check=True, timeout=300)
        lib = ctypes.CDLL(so)
        for fn, (argtypes, restype) in cpu_kernels._SIGNATURES[name].items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
        libs[name] = lib
    return libs


def use(side_libs: dict[str, ctypes.CDLL] | None, own_load) -> None:
    """Point kernels.cpu_kernels' loaders at side_libs for their kernels (None: this tree's)."""
    cpu_kernels._load = own_load if side_libs is None else (lambda name: side_libs.get(name) or own_load(name))
    for loader in LOADERS:
        loader.cache_clear()


def alternate(sides: dict[str, dict[str, ctypes.CDLL] | None], rounds: int, run: Callable[[str, int], T]) -> dict[str, list[T]]:
    """run(side, round) for each side in each round, with that side's kernels loaded (None: this
    tree's), which side goes first taking turns; this tree's kernels loaded again after."""
    own_load = cpu_kernels._load
    out: dict[str, list[T]] = {side: [] for side in sides}
    try:
        for r in range(rounds):
            order = list(sides.items())
            for side, libs in order if r % 2 == 0 else order[::-1]:
                use(libs, own_load)
                out[side].append(run(side, r))
    finally:
        use(None, own_load)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels/csrc is the other side")
    ap.add_argument("--kernels", default="gemm_bf16", help="comma-separated kernel names to swap")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    names = args.kernels.split(",")
    unknown = set(names) - set(cpu_kernels._SIGNATURES)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}")
    path = make_random_llama(os.path.join(HERE, ".cache", "llama-58m"))
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"this tree": None, args.base: build_base(args.base, names, tmp)}
        eng = engine(path, args.dtype, True)
        timed_run(eng, 0)        # warm-up (the first run of a process is slower), not counted
        load = [os.getloadavg()[0]]

        def run(side: str, repeat: int) -> dict[str, float]:     # fresh prompts for every run: no prefix-cache hits
            r = timed_run(eng, 1 + repeat * len(sides) + list(sides).index(side))
            print(f"  {side:12s} {r['tok_s']:6.0f} tok/s  prefill {r['prefill_s'] * 1e3:5.0f} ms  "
                  f"decode {r['decode_ms_per_step']:5.2f} ms/step", flush=True)
            return r
        runs = alternate(sides, args.repeats, run)
        load.append(os.getloadavg()[0])
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    for side, m in medians.items():
        print(f"{side:12s} median {m['tok_s']:6.0f} tok/s  prefill {m['prefill_s'] * 1e3:5.0f} ms  "
              f"decode {m['decode_ms_per_step']:5.2f} ms/step")
    decode = [a["decode_ms_per_step"] / b["decode_ms_per_step"] for a, b in zip(*runs.values())]
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(*runs.values())]
    print(f"this tree / {args.base} tok/s, run by run: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f}); decode ms/step ratio median {statistics.median(decode):.3f}; "
          f"load average {load[0]:.1f} -> {load[1]:.1f}")
    print("wrote", write_result("kernel_ab", {"dtype": args.dtype, "base": args.base, "kernels": names, "runs": runs,
                                              "medians": medians, "load_avg": load}))


if __name__ == "__main__":
    main()
