"""bfloat16 CPU linear layers through pdserve's own GEMM (kernels/gemm_bf16.py: AVX512-BF16's
vdpbf16ps, float32 accumulation), the weight packed once at load into the kernel's tiled pair
layout (engine/gemm_linear.py, shared with engine/f32_linear.py).

engine/packed_linear.py's pack_linears picks this for bfloat16 CPU models when the CPU has
AVX512-BF16 (`kernels.gemm_bf16.supported()`), at every row count, so no second copy of the
weight is kept for a fallback: on the benchmark machine it was 0.8x oneDNN's bf16 time at a
decode step's 32 rows (weights from memory) and within noise of it at 1 and 128 rows; at 2048
rows (prefill chunks) oneDNN was ahead on some shapes (bench/README.md, "bfloat16 decode
step"). PDSERVE_BF16_GEMM=0 turns it off (oneDNN's packed path then, as on CPUs without
AVX512-BF16), for A/B measurements.
"""
from __future__ import annotations

from engine.gemm_linear import GemmLinear
from kernels import gemm_bf16


class Bf16Linear(GemmLinear):
    """y = x @ W^T + b, bf16, W held in gemm_bf16's packed layout (opaque: no `.weight`)."""

    gemm = gemm_bf16.GEMM
    switch = "PDSERVE_BF16_GEMM"


can_use = Bf16Linear.can_use    # can_use(dtype, device): whether linears there would use Bf16Linear
