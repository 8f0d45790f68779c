"""bfloat16 linear on CPU through the C kernel kernels/csrc/gemm_bf16.c (AVX512-BF16's
vdpbf16ps, float32 accumulation): out = x @ W^T + bias, W packed once by `pack_weight`.

oneDNN's bf16 path on a CPU with AVX512-BF16 but no AMX (the 2-core AMD EPYC the benchmarks run
on) multiplies a decode step's 32 rows 1.3-1.5x slower than its fp32 path (bench/README.md,
"bfloat16 decode step"); this kernel is what engine/bf16_linear.py uses instead.

    packed: [ceil(n / TILE_N), ceil(k / 2), TILE_N, 2] bf16
    packed[t, p, c, j] = W[t * TILE_N + c, 2 * p + j], zero past n or k

`supported()` is False where the C library did not build or the compiler did not target
AVX512-BF16; callers keep oneDNN (or F.linear) there. `reference()` is what tests compare with.
"""
from __future__ import annotations

import functools

import torch

from kernels.checks import require, require_dtype
from kernels.cpu_kernels import gemm_bf16_lib


@functools.cache
def supported() -> bool:
    """Whether the bf16 GEMM kernel runs on this CPU (built, and built with AVX512-BF16)."""
    lib = gemm_bf16_lib()
    return lib is not None and lib.gemm_bf16_supported() == 1


@functools.cache
def tile_n() -> int:
    """Columns per packed tile (the C file's TILE_N)."""
    return gemm_bf16_lib().gemm_bf16_tile_n()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [n, k] bf16 (a linear's weight) in the kernel's tiled pair layout (a new tensor)."""
    require(supported(), "gemm_bf16: the kernel is not available on this CPU (not built, or built without "
            "AVX512-BF16); use oneDNN's packed linear")
    require_dtype("weight", weight, torch.bfloat16)
    require(weight.dim() == 2 and weight.device.type == "cpu" and weight.numel() > 0,
            f"weight: expected a non-empty 2-d CPU tensor, got {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    tile = tile_n()
    padded = weight.new_zeros(-(-n // tile) * tile, -(-k // 2) * 2)
    padded[:n, :k] = weight
    return padded.view(-1, tile, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] bf16 (rows with stride 1 in k) times the packed W [n, k], plus bias [n]:
    a new [m, n] bf16 tensor. Raises ValueError for inputs that do not fit together."""
    check_weight(packed, n, bias)
    check_rows(x, packed)
    return product(x, packed, n, None if bias is None else bias.contiguous())


def check_weight(packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
    """The packed weight (from pack_weight) of n outputs, and its bias: once, at load."""
    require_dtype("packed", packed, torch.bfloat16)
    tile = tile_n()
    require(packed.dim() == 4 and packed.shape[2:] == (tile, 2) and packed.is_contiguous()
            and packed.device.type == "cpu", f"packed: expected a contiguous [tiles, pairs, {tile}, 2] CPU "
            f"tensor from pack_weight, got {tuple(packed.shape)}")
    require(0 < n and -(-n // tile) == packed.shape[0], f"n = {n} does not fit {packed.shape[0]} tiles of {tile}")
    if bias is not None:
        require_dtype("bias", bias, torch.bfloat16)
        require(bias.shape == (n,) and bias.device.type == "cpu",
                f"bias: expected a CPU tensor of shape ({n},), got {tuple(bias.shape)}")


def check_rows(x: torch.Tensor, packed: torch.Tensor) -> None:
    """x [m, k] against a packed weight that check_weight accepted: every call."""
    require_dtype("x", x, torch.bfloat16)
    require(x.dim() == 2 and x.device.type == "cpu" and x.stride(1) == 1,
            f"x: expected a 2-d CPU tensor with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    k = x.shape[1]
    require(k > 0 and packed.shape[1] == -(-k // 2), f"x has k = {k}, packed holds {packed.shape[1]} k pairs")


def product(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel call, unchecked: inputs that check_weight (bias contiguous) and check_rows
    accepted."""
    m, k = x.shape
    out = torch.empty((m, n), dtype=torch.bfloat16)
    gemm_bf16_lib().gemm_bf16(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), n, m, n, k, torch.get_num_threads())
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float32 (x.float() @ W.float().T + bias), rounded to bf16 once."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out += bias.float()
    return out.to(torch.bfloat16)
