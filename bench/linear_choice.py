"""Which linears an engine made next packs (engine/packed_linear.py reads the switches once,
when it packs them), for the benchmarks that set one engine against another in one process."""
from __future__ import annotations

import os

SWITCHES = ("PDSERVE_AMX_GEMM", "PDSERVE_BF16_GEMM", "PDSERVE_F32_GEMM")


def choose_linears(gemm: bool, vdpbf16ps: bool = False) -> None:
    """gemm: pdserve's default GEMM for the dtype on this CPU (bf16: AMX's where it runs, else
    vdpbf16ps'; vdpbf16ps asks for the latter even on AMX); else oneDNN's packed linears."""
    for flag in SWITCHES:
        os.environ.pop(flag, None)
    if not gemm:
        os.environ["PDSERVE_BF16_GEMM"] = os.environ["PDSERVE_F32_GEMM"] = "0"
    elif vdpbf16ps:
        os.environ["PDSERVE_BF16_GEMM"] = "1"
