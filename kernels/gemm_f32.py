"""float32 linear on CPU through the C kernel kernels/csrc/gemm_f32.c (AVX-512 FMA, 6 x 64 register
blocks, the next weight tile prefetched into L2): out = x @ W^T + bias, W packed once by
`pack_weight`.

What engine/f32_linear.py uses for a float32 step's few rows (decode) instead of oneDNN's packed
linear (bench/README.md, "float32 GEMM").

    packed: [ceil(n / TILE_N), k, TILE_N] float32
    packed[t, kk, c] = W[t * TILE_N + c, kk], zero past n

`supported()` is False where the C library did not build or the compiler did not target
AVX-512F; callers keep oneDNN there. `reference()` is what tests compare with.
"""
from __future__ import annotations

import functools

import torch

from kernels.checks import require, require_dtype
from kernels.cpu_kernels import gemm_f32_lib


@functools.cache
def supported() -> bool:
    """Whether the float32 GEMM kernel runs on this CPU (built, and built with AVX-512F)."""
    lib = gemm_f32_lib()
    return lib is not None and lib.gemm_f32_supported() == 1


@functools.cache
def tile_n() -> int:
    """Columns per packed tile (the C file's TILE_N)."""
    return gemm_f32_lib().gemm_f32_tile_n()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [n, k] float32 (a linear's weight) in the kernel's tiled layout (a new tensor)."""
    require(supported(), "gemm_f32: the kernel is not available on this CPU (not built, or built without "
            "AVX-512F); use oneDNN's packed linear")
    require_dtype("weight", weight, torch.float32)
    require(weight.dim() == 2 and weight.device.type == "cpu" and weight.numel() > 0,
            f"weight: expected a non-empty 2-d CPU tensor, got {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    tile = tile_n()
    padded = weight.new_zeros(-(-n // tile) * tile, k)
    padded[:n] = weight
    return padded.view(-1, tile, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] float32 (rows with stride 1 in k) times the packed W [n, k], plus bias [n]: a new
    [m, n] float32 tensor. Raises ValueError for inputs that do not fit together."""
    check_weight(packed, n, bias)
    check_rows(x, packed)
    return product(x, packed, n, None if bias is None else bias.contiguous())


def check_weight(packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
    """The packed weight (from pack_weight) of n outputs, and its bias: once, at load."""
    require_dtype("packed", packed, torch.float32)
    tile = tile_n()
    require(packed.dim() == 3 and packed.shape[2] == tile and packed.is_contiguous()
            and packed.device.type == "cpu", f"packed: expected a contiguous [tiles, k, {tile}] CPU tensor "
            f"from pack_weight, got {tuple(packed.shape)}")
    require(0 < n and -(-n // tile) == packed.shape[0], f"n = {n} does not fit {packed.shape[0]} tiles of {tile}")
    if bias is not None:
        require_dtype("bias", bias, torch.float32)
        require(bias.shape == (n,) and bias.device.type == "cpu",
                f"bias: expected a CPU tensor of shape ({n},), got {tuple(bias.shape)}")


def check_rows(x: torch.Tensor, packed: torch.Tensor) -> None:
    """x [m, k] against a packed weight that check_weight accepted: every call."""
    require_dtype("x", x, torch.float32)
    require(x.dim() == 2 and x.device.type == "cpu" and x.stride(1) == 1,
            f"x: expected a 2-d CPU tensor with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    require(x.shape[1] > 0 and packed.shape[1] == x.shape[1], f"x has k = {x.shape[1]}, packed holds {packed.shape[1]}")


def product(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel call, unchecked: inputs that check_weight (bias contiguous) and check_rows
    accepted."""
    m, k = x.shape
    out = torch.empty((m, n), dtype=torch.float32)
    gemm_f32_lib().gemm_f32(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                            out.data_ptr(), n, m, n, k, torch.get_num_threads())
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64 (x @ W.T + bias), for tests to compare against."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    return out
