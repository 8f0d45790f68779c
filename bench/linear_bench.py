"""One decode step's linears alone: 32 rows through the bench model's weight shapes, float32
against bfloat16, in each layout pdserve could use (oneDNN packed, which engine/packed_linear.py
uses; F.linear; a matmul with the weight transposed once). Shows whether a dtype's linear is
bound by memory (bfloat16 moves half the bytes) or by compute on this CPU; the memory-copy
ceiling runs in the same script.

    python bench/linear_bench.py [--rows 32] [--iters 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import write_result  # noqa: E402
from engine.packed_linear import onednn_packs  # noqa: E402
from kernels import gemm_avx2, gemm_bf16, gemm_f32  # noqa: E402

SHAPES = {"qkv_proj": (512, 1536), "gate_up_proj": (512, 2816), "down_proj": (1408, 512), "lm_head": (512, 32000)}


COLD_BYTES = 96 << 20     # weight copies per shape with --cold: past a 32 MiB L3 three times


def _ms(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def _interleaved(fns: dict, iters: int, rounds: int = 5) -> dict[str, float]:
    """Median ms per call of each fn over `rounds` rounds of iters // rounds calls, the fns taking
    turns within a round: a shared machine's load then weighs on each alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_ms(fn, max(1, iters // rounds)))
    return {name: statistics.median(t) for name, t in times.items()}


def _cycling(call, weights: list):
    """A no-argument fn calling call(w) with the next weight of the list each time."""
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % len(weights)
        return call(weights[state["i"]])
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--cold", action="store_true", help="weights from memory, not cache (see above)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    # pdserve's GEMM per dtype: AVX-512's (vdpbf16ps, 16 lanes), else AVX2's (kernels/gemm_avx2.py)
    ours = {torch.bfloat16: next((g for g in (gemm_bf16, gemm_avx2.BF16) if g.supported()), None),
            torch.float32: next((g for g in (gemm_f32, gemm_avx2.F32) if g.supported()), None)}
    names = {g: n for g, n in ((gemm_bf16, "vdpbf16ps"), (gemm_f32, "AVX-512"), (gemm_avx2.BF16, "AVX2"),
                               (gemm_avx2.F32, "AVX2"), (None, "unavailable"))}
    print(f"ms per call, {args.rows} rows, {torch.get_num_threads()} threads, {'cold' if args.cold else 'warm'} "
          f"weights, pdserve GEMMs: bf16 {names[ours[torch.bfloat16]]}, fp32 {names[ours[torch.float32]]}")
    for name, (k, n) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            copies = max(1, COLD_BYTES // (n * k * dtype.itemsize)) if args.cold else 1
            ws, x = [torch.randn(n, k).to(dtype) for _ in range(copies)], torch.randn(args.rows, k).to(dtype)
            wts = [w.t().contiguous() for w in ws]
            fns = {"f_linear_ms": _cycling(lambda w: torch.nn.functional.linear(x, w), ws),
                   "matmul_ms": _cycling(lambda wt: x @ wt, wts)}
            packed = []
            if onednn_packs(dtype):        # no oneDNN bf16 on an AVX2-only CPU
                packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
                fns["packed_ms"] = _cycling(lambda p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                                            packed)
            gemm = ours[dtype]
            if gemm is not None:
                mine = [gemm.pack_weight(w) for w in ws]
                fns["pdserve_gemm_ms"] = _cycling(lambda p: gemm.linear(x, p, n), mine)
            row = {"linear": name, "dtype": str(dtype).split(".")[1], "weight_mib": n * k * dtype.itemsize / 2**20,
                   **_interleaved(fns, args.iters)}
            del packed, wts, fns
            fastest = min(("packed_ms", "pdserve_gemm_ms"), key=lambda key: row.get(key, float("inf")))
            row["fastest_gbps"] = row["weight_mib"] * 2**20 / row[fastest] / 1e6
            rows.append(row)
            gemm = f"  pdserve GEMM {row['pdserve_gemm_ms']:6.3f}" if "pdserve_gemm_ms" in row else ""
            onednn = f"{row['packed_ms']:6.3f}" if "packed_ms" in row else "   n/a"
            print(f"  {name:13s} {row['dtype']:9s} {row['weight_mib']:6.1f} MiB  packed {onednn}  "
                  f"F.linear {row['f_linear_ms']:6.3f}  matmul {row['matmul_ms']:6.3f}{gemm}  "
                  f"(the faster packed one reads the weight at {row['fastest_gbps']:.1f} GB/s)", flush=True)
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ceiling = 2 * src.numel() / _ms(lambda: dst.copy_(src), 20) / 1e6      # bytes read + written
    print(f"  ceiling: memory copy {ceiling:.1f} GB/s (64 MiB, read + write); oneDNN bf16 support: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"  load average {os.getloadavg()}")
    write_result("linear_bench", {"rows": args.rows, "cold": args.cold, "results": rows, "memcpy_gbps": ceiling,
                                  "load_avg": os.getloadavg()})


if __name__ == "__main__":
    main()
