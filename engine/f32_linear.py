"""float32 CPU linear layers through pdserve's own GEMM (kernels/gemm_f32.py: AVX-512 FMA, 6 x 64
register blocks, the next weight tile prefetched into L2), the weight packed once at load into
the kernel's tiled layout (engine/gemm_linear.py, shared with engine/bf16_linear.py).

engine/packed_linear.py's pack_linears picks this for float32 CPU models when the CPU has AVX-512
(`kernels.gemm_f32.supported()`), at every row count, so no second copy of the weight is kept
for oneDNN: on the benchmark machine it took 0.76-0.91x oneDNN's time at a decode step's 32 rows
(weights from memory), and was within noise of it at 128 and 2048 rows (prefill chunks) on the
layer shapes (bench/README.md, "float32 GEMM"). PDSERVE_F32_GEMM=0 turns it off (oneDNN's packed
path then, as on CPUs without AVX-512), for A/B measurements.
"""
from __future__ import annotations

from engine.gemm_linear import GemmLinear
from kernels import gemm_f32


class F32Linear(GemmLinear):
    """y = x @ W^T + b, float32, W held in gemm_f32's packed layout (opaque: no `.weight`)."""

    gemm = gemm_f32.GEMM
    switch = "PDSERVE_F32_GEMM"


can_use = F32Linear.can_use     # can_use(dtype, device): whether linears there would use F32Linear
