"""float32 and bfloat16 linears on CPUs with AVX2 and FMA but no AVX-512, through the C kernels
kernels/csrc/gemm_avx2.c (6 x 16 register blocks of float32 FMAs; a bf16 weight widened to float32
in registers): out = x @ W^T + bias, W packed once by `pack_weight`.

    packed: [ceil(n / TILE_N), k, TILE_N] in the weight's dtype
    packed[t, kk, c] = W[t * TILE_N + c, kk], zero past n

`F32` and `BF16` are the two kernels; each `supported()` is False where the C library did not
build or the compiler did not target AVX2 and FMA. `reference()` is what tests compare with
(float64 for float32; float32 rounded once for bf16). Packing, checks and launch are
kernels/gemm_packed.py's, shared with gemm_f32 and gemm_bf16.
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import gemm_avx2_lib
from kernels.gemm_packed import PackedGemm

F32 = PackedGemm("gemm_avx2_f32", gemm_avx2_lib, torch.float32, k_group=1, isa="AVX2 and FMA",
                 reference_dtypes=(torch.float64, torch.float64))
BF16 = PackedGemm("gemm_avx2_bf16", gemm_avx2_lib, torch.bfloat16, k_group=1, isa="AVX2 and FMA",
                  reference_dtypes=(torch.float32, torch.bfloat16))
