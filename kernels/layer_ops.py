"""A decoder layer's small ops: RMSNorm (optionally fused with the residual add) and SiLU-and-mul.

CPU tensors go to one C call each (kernels/cpu_layer_ops.py); anything else, or a CPU without the
built library, takes the PyTorch path below, which computes what Hugging Face's modules compute.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_layer_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dim of x [T, n]. With `residual` [T, n]: residual += x
    first (in place: the residual stream), and the norm is of that sum."""
    if x.dim() == 2 and cpu_layer_ops.usable(x, weight, residual):
        return cpu_layer_ops.rms_norm(x, weight, eps, residual)
    if residual is not None:
        residual += x
        x = residual
    if x.dtype == torch.float32:        # one fused op; same math as below for float32
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [T, 2n] = [gate | up], as the fused gate_up projection gives it."""
    if x.dim() == 2 and cpu_layer_ops.usable(x):
        return cpu_layer_ops.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
