"""bfloat16 CPU linear layers through pdserve's own GEMM (kernels/gemm_bf16.py: AVX512-BF16's
vdpbf16ps, float32 accumulation), the weight packed once at load into the kernel's tiled pair
layout.

engine/packed_linear.py's pack_linears picks this for bfloat16 CPU models when the CPU has
AVX512-BF16 (`kernels.gemm_bf16.supported()`), at every row count, so no second copy of the
weight is kept for a fallback: on the benchmark machine it was 0.8x oneDNN's bf16 time at a
decode step's 32 rows (weights from memory) and within noise of it at 1 and 128 rows; at 2048
rows (prefill chunks) oneDNN was ahead on some shapes (bench/README.md, "bfloat16 decode
step"). PDSERVE_BF16_GEMM=0 turns it off (oneDNN's packed path then, as on CPUs without
AVX512-BF16), for A/B measurements.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.packed_linear import PackedLinear
from kernels import gemm_bf16


class Bf16Linear(PackedLinear):
    """y = x @ W^T + b, bf16, W held in gemm_bf16's packed layout (opaque: no `.weight`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        gemm_bf16.check_weight(self.packed_weight, self.out_features, self.bias)     # once, not per call

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return gemm_bf16.pack_weight(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            gemm_bf16.check_rows(x, self.packed_weight)        # raises the launcher's ValueError
        return gemm_bf16.product(x, self.packed_weight, self.out_features, self.bias)


def can_use(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype on this device would use Bf16Linear."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and os.environ.get("PDSERVE_BF16_GEMM", "1") != "0"
            and gemm_bf16.supported())
