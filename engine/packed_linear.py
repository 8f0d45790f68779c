"""CPU linear layers with their weights packed once, at load, into oneDNN's blocked layout.

`F.linear` on CPU calls MKL's sgemm, which re-packs the weight on every call and, on AMD CPUs,
takes a slower path than oneDNN. Packing once and calling oneDNN (as PyTorch's inductor does
when freezing a CPU model, and as vLLM's CPU backend does) is what decode needs: a decode
step multiplies a few rows by every weight. Measured here (2-core AMD EPYC, fp32, 32 rows):

    lm_head 512 -> 32000     F.linear 15.0 ms   packed 5.9 ms
    gate_up 512 -> 2816      F.linear 0.72 ms   packed 0.50 ms

oneDNN packs float32, and bfloat16/float16 where it reports native support. bfloat16 on a CPU
with AVX2 but no native bf16 (oneDNN has none there) goes to pdserve's AVX2 GEMM
(engine/avx2_linear.py; PDSERVE_AVX2_GEMM=0 keeps nn.Linear); other cases keep nn.Linear.
bfloat16 on a CPU with AMX tiles goes to pdserve's own AMX GEMM instead
(engine/amx_linear.py; PDSERVE_AMX_GEMM=0 keeps oneDNN there), on a CPU with AVX512-BF16 and no
AMX to its vdpbf16ps GEMM (engine/bf16_linear.py; PDSERVE_BF16_GEMM=0 keeps oneDNN for both), and float32 on a CPU with AVX-512 to
pdserve's float32 GEMM (engine/f32_linear.py; PDSERVE_F32_GEMM=0 keeps oneDNN).
PDSERVE_PACKED_LINEAR=0 turns all packing off (for A/B measurements).
"""
from __future__ import annotations

import os

import torch
from torch import nn



class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held packed by oneDNN (opaque: no `.weight`). A subclass packs
    for another kernel by overriding `pack` and `product` (engine/gemm_linear.py)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", self.pack(linear.weight.detach()), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, in_features] with contiguous rows -> [m, out_features]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.product(x.reshape(-1, self.in_features).contiguous())
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype on this device would be packed."""
    return packed_class(dtype, device) is not None


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs CPU linears of this dtype here: float32, and bfloat16/float16 where it
    reports native support (AVX-512 or newer for bf16; not on an AVX2-only CPU)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def packed_class(dtype: torch.dtype, device: torch.device) -> type | None:
    """The packed linear that pack_linears puts in place of nn.Linear of this dtype on this device:
    the first of pdserve's GEMMs that can be used here (AMX's, vdpbf16ps', AVX2's for bf16;
    AVX-512's, then AVX2's, for float32; one whose switch is set to 1 before the others), else oneDNN's PackedLinear where oneDNN packs the dtype, else None
    (the linears stay nn.Linear)."""
    if device.type != "cpu" or os.environ.get("PDSERVE_PACKED_LINEAR", "1") == "0":
        return None
    from engine import amx_linear, avx2_linear, bf16_linear, f32_linear   # subclasses of PackedLinear: imported here, as they import this module
    gemms = (amx_linear.AmxLinear, bf16_linear.Bf16Linear, avx2_linear.Avx2Bf16Linear, f32_linear.F32Linear,
             avx2_linear.Avx2F32Linear)
    asked = [cls for cls in gemms if os.environ.get(cls.switch) == "1"]    # a switch set to 1: that GEMM first
    for cls in asked + [cls for cls in gemms if cls not in asked]:
        if cls.can_use(dtype, device):
            return cls
    return PackedLinear if onednn_packs(dtype) else None


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear under `model` by the packed linear `packed_class` picks (decided
    by the first linear's dtype and device), in place; none where it picks None. Call after any
    weight surgery (e.g. tensor-parallel sharding): a packed weight cannot be sliced. Returns how
    many were packed."""
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    if not linears:
        return 0
    packed = packed_class(linears[0][2].weight.dtype, linears[0][2].weight.device)
    if packed is None:
        return 0
    for parent, name, child in linears:
        setattr(parent, name, packed(child))
    return len(linears)
