"""float32 linear on CPU through the C kernel kernels/csrc/gemm_f32.c (AVX-512 FMA, 6 x 64 register
blocks, the next weight tile prefetched into L2): out = x @ W^T + bias, W packed once by
`pack_weight`.

What engine/f32_linear.py uses for a float32 step's few rows (decode) instead of oneDNN's packed
linear (bench/README.md, "float32 GEMM").

    packed: [ceil(n / TILE_N), k, TILE_N] float32
    packed[t, kk, c] = W[t * TILE_N + c, kk], zero past n

`supported()` is False where the C library did not build or the compiler did not target
AVX-512F; callers keep oneDNN there. `reference()` (the product in float64) is what tests
compare with. Packing, checks and launch are kernels/gemm_packed.py's, shared with gemm_bf16.
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import gemm_f32_lib
from kernels.gemm_packed import PackedGemm

GEMM = PackedGemm("gemm_f32", gemm_f32_lib, torch.float32, k_group=1, isa="AVX-512F",
                  reference_dtypes=(torch.float64, torch.float64))
supported, tile_n, pack_weight, linear = GEMM.supported, GEMM.tile_n, GEMM.pack_weight, GEMM.linear
check_weight, check_rows, product, reference = GEMM.check_weight, GEMM.check_rows, GEMM.product, GEMM.reference
