"""bfloat16 linear on CPU through the C kernel kernels/csrc/gemm_amx.c (AMX tiles' tdpbf16ps,
float32 accumulation): out = x @ W^T + bias, W packed once by `pack_weight`.

The packed layout is gemm_bf16's (kernels/gemm_bf16.py) with k padded to a multiple of 32, a tile
step's k:

    packed: [ceil(n / TILE_N), ceil(k / 32) * 16, TILE_N, 2] bf16
    packed[t, p, c, j] = W[t * TILE_N + c, 2 * p + j], zero past n or k

`supported()` is False where the C library did not build, the compiler did not target AMX-BF16,
or Linux did not grant this process the tiles; callers keep oneDNN (or gemm_bf16) there.
`reference()` (the product in float32, rounded to bf16 once) is what tests compare with.
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import gemm_amx_lib
from kernels.gemm_packed import PackedGemm

GEMM = PackedGemm("gemm_amx", gemm_amx_lib, torch.bfloat16, k_group=2, isa="AMX-BF16",
                  reference_dtypes=(torch.float32, torch.bfloat16), k_pad=32)
supported, tile_n, pack_weight, linear = GEMM.supported, GEMM.tile_n, GEMM.pack_weight, GEMM.linear
check_weight, check_rows, product, reference = GEMM.check_weight, GEMM.check_rows, GEMM.product, GEMM.reference
