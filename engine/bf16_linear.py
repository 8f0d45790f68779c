"""bfloat16 CPU linear layers through pdserve's own GEMM (kernels/gemm_bf16.py: AVX512-BF16's
vdpbf16ps, float32 accumulation), the weight packed once at load into the kernel's tiled pair
layout (engine/gemm_linear.py, shared with engine/f32_linear.py).

engine/packed_linear.py's pack_linears picks this for bfloat16 CPU models when the CPU has
AVX512-BF16 (`kernels.gemm_bf16.supported()`) and no AMX tiles, at every row count, so no
second copy of the weight is kept for a fallback: on an AMD EPYC (AVX512-BF16, no AMX) it was
0.8x oneDNN's bf16 time at a decode step's 32 rows (weights from memory) and within noise of it
at 1 and 128 rows; at 2048 rows (prefill chunks) oneDNN was ahead on some shapes (bench/README.md,
"bfloat16 decode step"). Where the CPU has AMX (`torch.cpu._is_amx_tile_supported()`), oneDNN
multiplies bf16 on the tiles and this kernel loses at every batch past one: on an Intel Xeon with
AMX, 3.1x oneDNN's time at 32 rows and 9x at 2048 (bench/README.md, "bfloat16 on a CPU with
AMX"), so there oneDNN's packed path is the default. PDSERVE_BF16_GEMM=0 turns this kernel off,
=1 turns it on even where the CPU has AMX, for A/B measurements.
"""
from __future__ import annotations

import os

import torch

from engine.gemm_linear import GemmLinear
from kernels import gemm_bf16


class Bf16Linear(GemmLinear):
    """y = x @ W^T + b, bf16, W held in gemm_bf16's packed layout (opaque: no `.weight`)."""

    gemm = gemm_bf16.GEMM
    switch = "PDSERVE_BF16_GEMM"

    @classmethod
    def can_use(cls, dtype: torch.dtype, device: torch.device) -> bool:
        """GemmLinear's test, and no AMX tiles unless PDSERVE_BF16_GEMM=1 asks for this kernel."""
        return super().can_use(dtype, device) and (os.environ.get(cls.switch) == "1" or not has_amx())


def has_amx() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles (which oneDNN then uses)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


can_use = Bf16Linear.can_use    # can_use(dtype, device): whether linears there would use Bf16Linear
