"""The PackedLinear subclass that F32Linear (engine/f32_linear.py) and Bf16Linear
(engine/bf16_linear.py) share: the weight packed once at load into one of pdserve's GEMMs' tiled
layout (kernels/gemm_packed.py), checked once, and each call launched unchecked unless x is of
another dtype or device. A subclass names its kernel (`gemm`) and its off switch (`switch`).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.packed_linear import PackedLinear
from kernels.gemm_packed import PackedGemm


class GemmLinear(PackedLinear):
    """y = x @ W^T + b, W held in `gemm`'s packed layout (opaque: no `.weight`)."""

    gemm: PackedGemm            # the kernel (kernels.gemm_f32.GEMM, kernels.gemm_bf16.GEMM)
    switch: str                 # the environment variable that turns it off with "0"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.gemm.check_weight(self.packed_weight, self.out_features, self.bias)     # once, not per call

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return self.gemm.pack_weight(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.gemm.dtype or x.device.type != "cpu":
            self.gemm.check_rows(x, self.packed_weight)        # raises the launcher's ValueError
        return self.gemm.product(x, self.packed_weight, self.out_features, self.bias)

    @classmethod
    def can_use(cls, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether linears of this dtype on this device would use this class."""
        return (dtype == cls.gemm.dtype and device.type == "cpu" and os.environ.get(cls.switch, "1") != "0"
                and cls.gemm.supported())
