"""bfloat16 CPU linear layers on AMX tiles through pdserve's own GEMM (kernels/gemm_amx.py:
tdpbf16ps, float32 accumulation), the weight packed once at load into the kernel's tiled layout
(engine/gemm_linear.py, shared with engine/bf16_linear.py and engine/f32_linear.py).

engine/packed_linear.py's pack_linears picks this for bfloat16 CPU models when the CPU has AMX
tiles and Linux grants them (`kernels.gemm_amx.supported()`), at every row count, so no second
copy of the weight is kept for oneDNN. PDSERVE_AMX_GEMM=0 turns it off (oneDNN's packed path
then, as before it); PDSERVE_BF16_GEMM=0 keeps oneDNN and =1 takes the vdpbf16ps GEMM instead.
"""
from __future__ import annotations

import os

import torch

from engine.gemm_linear import GemmLinear
from kernels import gemm_amx


class AmxLinear(GemmLinear):
    """y = x @ W^T + b, bf16, W held in gemm_amx's packed layout (opaque: no `.weight`)."""

    gemm = gemm_amx.GEMM
    switch = "PDSERVE_AMX_GEMM"

    @classmethod
    def can_use(cls, dtype: torch.dtype, device: torch.device) -> bool:
        """GemmLinear's test, and PDSERVE_BF16_GEMM unset: =0 keeps oneDNN, =1 asks for the
        vdpbf16ps GEMM (engine/bf16_linear.py) even here, for A/B measurements."""
        return super().can_use(dtype, device) and os.environ.get("PDSERVE_BF16_GEMM") not in ("0", "1")


can_use = AmxLinear.can_use     # can_use(dtype, device): whether linears there would use AmxLinear
