"""bfloat16 CPU linear layers on CPUs with AVX2 and FMA but no native bfloat16 (AMD Zen 2 and 3,
Intel before Cooper Lake), through pdserve's own GEMM (kernels/gemm_avx2.py: the bf16 weight
widened to float32 in registers, float32 FMAs), the weight packed once at load into the kernel's
tiled layout (engine/gemm_linear.py, shared with engine/f32_linear.py and engine/bf16_linear.py).

There oneDNN reports no bf16 support, so without this kernel a bf16 linear stays an nn.Linear and
PyTorch multiplies it through its generic path: on a 2-core AMD EPYC (Zen 3) at a decode step's
32 rows, lm_head 512 -> 32000 took 58 ms that way against 8.9 ms here, and oneDNN's float32
packed linear 8.9 ms (a scratch timing, session 23; `python bench/linear_bench.py` has them now). engine/packed_linear.py's
pack_linears picks this for bfloat16 where `kernels.gemm_avx2.BF16.supported()` and oneDNN has
no native bf16; PDSERVE_AVX2_GEMM=0 turns it off (the linears stay nn.Linear), =1 turns it on
even where oneDNN multiplies bf16 natively, for A/B measurements. Avx2F32Linear, the same kernel
in float32, is the float32 default where there is no AVX-512 GEMM (PDSERVE_AVX2_F32_GEMM=0: oneDNN).
"""
from __future__ import annotations

import os

import torch

from engine.gemm_linear import GemmLinear
from kernels import gemm_avx2, gemm_f32


class Avx2Bf16Linear(GemmLinear):
    """y = x @ W^T + b, bf16, W held in gemm_avx2's packed layout (opaque: no `.weight`)."""

    gemm = gemm_avx2.BF16
    switch = "PDSERVE_AVX2_GEMM"

    @classmethod
    def can_use(cls, dtype: torch.dtype, device: torch.device) -> bool:
        """GemmLinear's test, and oneDNN without native bf16 here unless PDSERVE_AVX2_GEMM=1."""
        return super().can_use(dtype, device) and (os.environ.get(cls.switch) == "1"
                                                   or not torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Avx2F32Linear(GemmLinear):
    """y = x @ W^T + b, float32, W held in gemm_avx2's packed layout (opaque: no `.weight`)."""

    gemm = gemm_avx2.F32
    switch = "PDSERVE_AVX2_F32_GEMM"

    @classmethod
    def can_use(cls, dtype: torch.dtype, device: torch.device) -> bool:
        """GemmLinear's test, and no AVX-512 float32 GEMM here (kernels/gemm_f32.py) unless
        PDSERVE_AVX2_F32_GEMM=1; =0 leaves float32 to oneDNN. In the engine on an AVX2-only AMD EPYC
        (Zen 3) it took 34.0 ms a decode step against oneDNN's 43.0, 1.17x the tokens a second
        (`python bench/gemm_ab.py --dtype float32 --avx2-f32`, bench/README.md "An AVX2-only CPU")."""
        switch = os.environ.get(cls.switch)
        return super().can_use(dtype, device) and (switch == "1" or (switch != "0" and not gemm_f32.supported()))


can_use = Avx2Bf16Linear.can_use    # can_use(dtype, device): whether linears there would use Avx2Bf16Linear
