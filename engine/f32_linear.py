"""float32 CPU linear layers through pdserve's own GEMM (kernels/gemm_f32.py: AVX-512 FMA, 6 x 64
register blocks, the next weight tile prefetched into L2), the weight packed once at load into
the kernel's tiled layout.

engine/packed_linear.py's pack_linears picks this for float32 CPU models when the CPU has AVX-512
(`kernels.gemm_f32.supported()`), at every row count, so no second copy of the weight is kept
for oneDNN: on the benchmark machine it took 0.76-0.91x oneDNN's time at a decode step's 32 rows
(weights from memory), and was within noise of it at 128 and 2048 rows (prefill chunks) on the
layer shapes (bench/README.md, "float32 GEMM"). PDSERVE_F32_GEMM=0 turns it off (oneDNN's packed
path then, as on CPUs without AVX-512), for A/B measurements.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.packed_linear import PackedLinear
from kernels import gemm_f32


class F32Linear(PackedLinear):
    """y = x @ W^T + b, float32, W held in gemm_f32's packed layout (opaque: no `.weight`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        gemm_f32.check_weight(self.packed_weight, self.out_features, self.bias)     # once, not per call

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return gemm_f32.pack_weight(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            gemm_f32.check_rows(x, self.packed_weight)        # raises the launcher's ValueError
        return gemm_f32.product(x, self.packed_weight, self.out_features, self.bias)


def can_use(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype on this device would use F32Linear."""
    return (dtype == torch.float32 and device.type == "cpu" and os.environ.get("PDSERVE_F32_GEMM", "1") != "0"
            and gemm_f32.supported())
