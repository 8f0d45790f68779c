"""bfloat16 linear on CPU through the C kernel kernels/csrc/gemm_bf16.c (AVX512-BF16's
vdpbf16ps, float32 accumulation): out = x @ W^T + bias, W packed once by `pack_weight`.

oneDNN's bf16 path on a CPU with AVX512-BF16 but no AMX (the 2-core AMD EPYC the benchmarks run
on) multiplies a decode step's 32 rows 1.3-1.5x slower than its fp32 path (bench/README.md,
"bfloat16 decode step"); this kernel is what engine/bf16_linear.py uses instead.

    packed: [ceil(n / TILE_N), ceil(k / 2), TILE_N, 2] bf16
    packed[t, p, c, j] = W[t * TILE_N + c, 2 * p + j], zero past n or k

`supported()` is False where the C library did not build or the compiler did not target
AVX512-BF16; callers keep oneDNN (or F.linear) there. `reference()` (the product in float32,
rounded to bf16 once) is what tests compare with. Packing, checks and launch are
kernels/gemm_packed.py's, shared with gemm_f32.
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import gemm_bf16_lib
from kernels.gemm_packed import PackedGemm

GEMM = PackedGemm("gemm_bf16", gemm_bf16_lib, torch.bfloat16, k_group=2, isa="AVX512-BF16",
                  reference_dtypes=(torch.float32, torch.bfloat16))
supported, tile_n, pack_weight, linear = GEMM.supported, GEMM.tile_n, GEMM.pack_weight, GEMM.linear
check_weight, check_rows, product, reference = GEMM.check_weight, GEMM.check_rows, GEMM.product, GEMM.reference
