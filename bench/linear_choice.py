"""Which linears an engine made next packs (engine/packed_linear.py reads the switches once,
when it packs them), for the benchmarks that set one engine against another in one process."""
from __future__ import annotations

import os

SWITCHES = ("PDSERVE_AMX_GEMM", "PDSERVE_BF16_GEMM", "PDSERVE_F32_GEMM", "PDSERVE_AVX2_GEMM", "PDSERVE_AVX2_F32_GEMM")


def choose_linears(gemm: bool, vdpbf16ps: bool = False, avx2_f32: bool = False) -> None:
    """gemm: pdserve's default GEMM for the dtype on this CPU (bf16: AMX's where it runs, else
    vdpbf16ps', else AVX2's; vdpbf16ps asks for the second even on AMX; avx2_f32 asks for AVX2's
    float32 GEMM, the default where there is no AVX-512); else oneDNN's packed linears (for bf16 on an AVX2-only
    CPU, where oneDNN has no bf16: nn.Linear)."""
    for flag in SWITCHES:
        os.environ.pop(flag, None)
    if not gemm:
        for flag in ("PDSERVE_BF16_GEMM", "PDSERVE_F32_GEMM", "PDSERVE_AVX2_GEMM", "PDSERVE_AVX2_F32_GEMM"):
            os.environ[flag] = "0"
    elif avx2_f32:
        os.environ["PDSERVE_AVX2_F32_GEMM"] = "1"
    elif vdpbf16ps:
        os.environ["PDSERVE_BF16_GEMM"] = "1"
