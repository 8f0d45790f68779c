"""What pdserve's two CPU GEMMs (kernels/gemm_f32.py, kernels/gemm_bf16.py) share: the weight
packed once into tiles of TILE_N columns, the checks (once at load on the weight, every call on
x) and the launcher of the C library's `<name>(x, x_stride, packed, bias, out, out_stride, m, n,
k, threads)`. One `PackedGemm` per kernel, parameterized by the dtype, the library and how many
adjacent k elements a packed column holds together (`k_group`: 1 for float32, 2 for bf16's
vdpbf16ps pairs):

    packed: [ceil(n / TILE_N), ceil(k / k_group), TILE_N(, k_group where > 1)]
    packed[t, p, c(, j)] = W[t * TILE_N + c, k_group * p (+ j)], zero past n or k

with k first padded to a multiple of `k_pad` where a kernel reads k in whole steps (gemm_amx: 32).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from kernels import huge_pages
from kernels.checks import require, require_dtype


class PackedGemm:
    """One C GEMM kernel: `supported`, `tile_n`, `pack_weight`, `linear` (checked), `check_weight`
    and `check_rows` (the checks split for callers that check once), `product` (unchecked) and
    `reference`. `supported` and `tile_n` are cached (functools: `supported.cache_clear()`)."""

    def __init__(self, name: str, lib: Callable, dtype: torch.dtype, k_group: int, isa: str,
                 reference_dtypes: tuple[torch.dtype, torch.dtype], k_pad: int = 1):
        self.name, self.lib, self.dtype, self.k_group, self.isa = name, lib, dtype, k_group, isa
        self.k_pad = k_pad * k_group // math.gcd(k_pad, k_group)     # k padded to a multiple of this
        self.reference_dtypes = reference_dtypes      # (the sum's, the result's)
        self.supported = functools.cache(self._supported)
        self.tile_n = functools.cache(self._tile_n)

    def _supported(self) -> bool:
        """Whether the kernel runs on this CPU (built, and built with its instruction set)."""
        lib = self.lib()
        return lib is not None and getattr(lib, f"{self.name}_supported")() == 1

    def _tile_n(self) -> int:
        """Columns per packed tile (the C file's TILE_N)."""
        return getattr(self.lib(), f"{self.name}_tile_n")()

    def tile_shape(self) -> tuple[int, ...]:
        """The packed weight's trailing dims: (TILE_N,) or (TILE_N, k_group)."""
        return (self.tile_n(),) if self.k_group == 1 else (self.tile_n(), self.k_group)

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """W [n, k] (a linear's weight) in the kernel's tiled layout (a new tensor)."""
        require(self.supported(), f"{self.name}: the kernel is not available on this CPU (not built, or built "
                f"without {self.isa}); use oneDNN's packed linear")
        require_dtype("weight", weight, self.dtype)
        require(weight.dim() == 2 and weight.device.type == "cpu" and weight.numel() > 0,
                f"weight: expected a non-empty 2-d CPU tensor, got {tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        tile, group = self.tile_n(), self.k_group
        padded = weight.new_zeros(-(-n // tile) * tile, self.padded_k(k))
        padded[:n, :k] = weight
        tiles = padded.view(-1, tile, padded.shape[1] // group, group).transpose(1, 2)
        packed = huge_pages.empty(tiles.shape, self.dtype).copy_(tiles)     # a step streams it: huge pages if big
        return packed.view(*packed.shape[:2], *self.tile_shape())

    def padded_k(self, k: int) -> int:
        """k rounded up to the packed layout's multiple (k_group, and k_pad where a kernel's tiles need it)."""
        return -(-k // self.k_pad) * self.k_pad

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] (rows with stride 1 in k) times the packed W [n, k], plus bias [n]: a new [m, n]
        tensor of the kernel's dtype. Raises ValueError for inputs that do not fit together."""
        self.check_weight(packed, n, bias)
        self.check_rows(x, packed)
        return self.product(x, packed, n, None if bias is None else bias.contiguous())

    def check_weight(self, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> None:
        """The packed weight (from pack_weight) of n outputs, and its bias: once, at load."""
        require_dtype("packed", packed, self.dtype)
        tile, trailing = self.tile_n(), self.tile_shape()
        require(packed.dim() == 2 + len(trailing) and packed.shape[2:] == trailing and packed.is_contiguous()
                and packed.device.type == "cpu", f"packed: expected a contiguous [tiles, {'k' if self.k_group == 1 else 'pairs'}, "
                f"{', '.join(map(str, trailing))}] CPU tensor from pack_weight, got {tuple(packed.shape)}")
        require(0 < n and -(-n // tile) == packed.shape[0], f"n = {n} does not fit {packed.shape[0]} tiles of {tile}")
        if bias is not None:
            require_dtype("bias", bias, self.dtype)
            require(bias.shape == (n,) and bias.device.type == "cpu",
                    f"bias: expected a CPU tensor of shape ({n},), got {tuple(bias.shape)}")

    def check_rows(self, x: torch.Tensor, packed: torch.Tensor) -> None:
        """x [m, k] against a packed weight that check_weight accepted: every call."""
        require_dtype("x", x, self.dtype)
        require(x.dim() == 2 and x.device.type == "cpu" and x.stride(1) == 1,
                f"x: expected a 2-d CPU tensor with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
        k = x.shape[1]
        require(k > 0 and packed.shape[1] == self.padded_k(k) // self.k_group,
                f"x has k = {k}, packed holds {packed.shape[1]} k{'' if self.k_group == 1 else ' pairs'}")

    def product(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """The kernel call, unchecked: inputs that check_weight (bias contiguous) and check_rows
        accepted."""
        m, k = x.shape
        out = torch.empty((m, n), dtype=self.dtype)
        failed = getattr(self.lib(), self.name)(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                                None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
                                                torch.get_num_threads())
        if failed:      # None from the kernels that cannot fail; -1: a scratch allocation failed
            raise MemoryError(f"{self.name}: could not allocate its scratch memory")
        return out

    def reference(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The same product (x @ W.T + bias) summed in reference_dtypes[0] and returned in [1], for
        tests to compare against: float64 for float32, float32 rounded to bf16 once for bf16."""
        wide, result = self.reference_dtypes
        out = x.to(wide) @ weight.to(wide).T
        if bias is not None:
            out += bias.to(wide)
        return out.to(result)
