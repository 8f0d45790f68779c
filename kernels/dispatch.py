"""Which path a kernel call takes: the Triton kernels for CUDA tensors, the CPU path otherwise.

PDSERVE_TRITON_ON_CPU=1 together with TRITON_INTERPRET=1 sends CPU tensors to the Triton
kernels too, run by Triton's interpreter: slow, and only for tests, which so run the whole
engine on the GPU's code path without a GPU (tests/engine/test_engine_triton_interpret.py). Both are
read once, at import. The engine's start-up check of head shapes (unsupported_attention) keys
on the device, so such a test must use a head size the Triton kernels take.
"""
from __future__ import annotations

import os

import torch

TRITON_ON_CPU = os.environ.get("PDSERVE_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or TRITON_ON_CPU
