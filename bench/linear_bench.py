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
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine import write_result  # noqa: E402

SHAPES = {"qkv_proj": (512, 1536), "gate_up_proj": (512, 2816), "down_proj": (1408, 512), "lm_head": (512, 32000)}


def _ms(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"ms per call, {args.rows} rows, {torch.get_num_threads()} threads")
    for name, (k, n) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            w, x = torch.randn(n, k).to(dtype), torch.randn(args.rows, k).to(dtype)
            packed, wt = torch.ops.mkldnn._reorder_linear_weight(w), w.t().contiguous()
            row = {"linear": name, "dtype": str(dtype).split(".")[1], "weight_mib": w.numel() * w.element_size() / 2**20,
                   "packed_ms": _ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.iters),
                   "f_linear_ms": _ms(lambda: torch.nn.functional.linear(x, w), args.iters),
                   "matmul_ms": _ms(lambda: x @ wt, args.iters)}
            row["packed_gbps"] = row["weight_mib"] * 2**20 / row["packed_ms"] / 1e6
            rows.append(row)
            print(f"  {name:13s} {row['dtype']:9s} {row['weight_mib']:6.1f} MiB  packed {row['packed_ms']:6.3f}  "
                  f"F.linear {row['f_linear_ms']:6.3f}  matmul {row['matmul_ms']:6.3f}  "
                  f"(packed reads the weight at {row['packed_gbps']:.1f} GB/s)")
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ceiling = 2 * src.numel() / _ms(lambda: dst.copy_(src), 20) / 1e6      # bytes read + written
    print(f"  ceiling: memory copy {ceiling:.1f} GB/s (64 MiB, read + write); oneDNN bf16 support: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    write_result("linear_bench", {"rows": args.rows, "results": rows, "memcpy_gbps": ceiling})


if __name__ == "__main__":
    main()
