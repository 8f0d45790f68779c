"""Greedy sampling's argmax over a step's logits, on CPU through kernels/csrc/argmax.c.

torch.argmax(dim=-1) on CPU is a scalar reduction: 0.6 ms for a decode step's [32, 32000]
float32 logits on the benchmark machine, 2-3.5 ms over bfloat16 (so a bf16 model's logits were
cast to float32 first). The C pass takes either dtype and picks the same index torch.argmax
does (first among equal maxima, NaN largest): a bf16 model's greedy rows need no cast at all.

`argmax(logits)` falls back to torch.argmax where the C path does not apply (another device or
dtype, the library not built); `reference` is what the tests compare against.
"""
from __future__ import annotations

import torch

from kernels.checks import require
from kernels.cpu_kernels import DTYPES, argmax_lib

C_DTYPES = (torch.float32, torch.bfloat16)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value: logits [R, vocab] -> [R] int64, on logits' device.
    Raises ValueError for a tensor that is not 2-d or has no columns."""
    require(logits.dim() == 2 and logits.shape[1] > 0,
            f"logits: expected a [rows, vocab] tensor with vocab > 0, got {tuple(logits.shape)}")
    if logits.device.type != "cpu" or logits.dtype not in C_DTYPES or argmax_lib() is None:
        return reference(logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    argmax_lib().argmax_rows(logits.data_ptr(), logits.stride(0), out.data_ptr(), rows, n, DTYPES[logits.dtype],
                             torch.get_num_threads())
    return out


def reference(logits: torch.Tensor) -> torch.Tensor:
    """The same choice by PyTorch."""
    return logits.argmax(dim=-1)
