"""pdserve's packed GEMMs against the CPU's FMA ceiling, measured in the same run: GFLOP/s per shape of
the bench model (58.5M Llama) at a decode step's rows and at a prefill step's, weights warm (one copy
called again and again), and a decode step's linears with every layer's own weights (cold: 168 MB
cycled, as the engine reads them), beside bench/fma_peak.c (12 chains of 8-lane FMAs a thread).

    python bench/gemm_rate.py [--rows 32,2048] [--dtype float32]

Which GEMM: pdserve's AVX-512 one for the dtype where the CPU has it (gemm_f32; gemm_bf16 with
AVX512-BF16), else the AVX2 kernel (gemm_avx2), the engine's defaults outside AMX hosts (whose bf16
GEMM, gemm_amx, is not timed here). Writes bench/results/gemm_rate_<time>.json.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import write_result  # noqa: E402
from kernels import gemm_avx2, gemm_bf16, gemm_f32  # noqa: E402

SHAPES = {"qkv_proj": (512, 1536), "o_proj": (512, 512), "gate_up_proj": (512, 2816), "down_proj": (1408, 512),
          "lm_head": (512, 32000)}
LAYERS = 8


def kernel(dtype: torch.dtype):
    """The packed GEMM for dtype here (see the module's docstring), and its name."""
    if dtype == torch.float32:
        return (gemm_f32.GEMM, "gemm_f32 (AVX-512)") if gemm_f32.supported() else (gemm_avx2.F32, "gemm_avx2 f32")
    return (gemm_bf16.GEMM, "gemm_bf16 (AVX-512 BF16)") if gemm_bf16.supported() else (gemm_avx2.BF16, "gemm_avx2 bf16")


def fma_peak(threads: int) -> float:
    """GFLOP/s of bench/fma_peak.c on `threads` threads (built here with the host compiler)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.c")
    exe = os.path.join(tempfile.mkdtemp(), "fma_peak")
    subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", "-o", exe, src], check=True, timeout=120)
    return float(subprocess.run([exe, str(threads)], check=True, capture_output=True, text=True, timeout=120).stdout)


def best_s(fn, flops: float, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    iters = max(3, int(2e9 / flops))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,2048")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gemm, name = kernel(dtype)
    if not gemm.supported():
        sys.exit(f"{name}: not supported on this CPU")
    threads = torch.get_num_threads()
    peak = fma_peak(threads)
    print(f"FMA ceiling ({threads} threads, 8-lane float32 FMAs): {peak:.1f} GFLOP/s; GEMM: {name}, {args.dtype}")
    torch.manual_seed(0)
    rows_list, results = [int(r) for r in args.rows.split(",")], []
    for rows in rows_list:
        for shape, (k, n) in SHAPES.items():
            if shape == "lm_head" and rows > 64:
                continue        # a prefill computes the last position's logits only
            packed, x = gemm.pack_weight(torch.randn(n, k).to(dtype)), torch.randn(rows, k).to(dtype)
            flops = 2.0 * rows * k * n
            s = best_s(lambda: gemm.linear(x, packed, n), flops)
            results.append({"rows": rows, "shape": shape, "ms": s * 1e3, "gflops": flops / s / 1e9})
            print(f"  rows {rows:5}  {shape:13} {s * 1e3:8.3f} ms  {flops / s / 1e9:6.1f} GFLOP/s  "
                  f"{flops / s / 1e9 / peak:5.0%} of the ceiling (warm)", flush=True)
    rows = rows_list[0]
    layers = [[(gemm.pack_weight(torch.randn(n, k).to(dtype)), k, n) for shape, (k, n) in SHAPES.items()
               if shape != "lm_head"] for _ in range(LAYERS)]
    k_head, n_head = SHAPES["lm_head"]
    head = gemm.pack_weight(torch.randn(n_head, k_head).to(dtype))
    xs = {k: torch.randn(rows, k).to(dtype) for k in (512, 1408)}

    def step():
        for layer in layers:
            for packed, k, n in layer:
                gemm.linear(xs[k], packed, n)
        gemm.linear(xs[k_head], head, n_head)

    flops = 2.0 * rows * (LAYERS * sum(k * n for s, (k, n) in SHAPES.items() if s != "lm_head") + k_head * n_head)
    times = []
    for _ in range(3):
        step()
    for _ in range(15):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    print(f"  a decode step's linears, {rows} rows, every layer's own weights (cold): {step_s * 1e3:.2f} ms "
          f"(median of 15), {flops / step_s / 1e9:.1f} GFLOP/s, {flops / step_s / 1e9 / peak:.0%} of the ceiling")
    path = write_result("gemm_rate", {"gemm": name, "dtype": args.dtype, "threads": threads, "fma_peak_gflops": peak,
                                      "shapes": results, "cold_step": {"rows": rows, "ms": step_s * 1e3,
                                                                       "gflops": flops / step_s / 1e9}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
