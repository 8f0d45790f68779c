"""Triton row copy (CUDA) behind copy_blocks, gather_blocks and scatter_blocks.

A "row" is one whole block of the pool (all layers, K and V: one contiguous region) or
one entry of a packed buffer. Program (i, c) copies chunks c, c + C, c + 2C, ... of row i:

    dst[dst_ids[i] or i, :] = src[src_ids[i] or i, :]

    copy_blocks:   src = dst = pool, both ids given
    gather_blocks: src = pool (src_ids), dst = buffer (row i)
    scatter_blocks: src = buffer (row i), dst = pool (dst_ids)

Bit-exact and dtype-agnostic: rows are viewed as int32 (int16 when the byte count is odd
in 4-byte words).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per chunk
MAX_CHUNK_PROGRAMS = 256  # grid axis 1; larger rows loop


class CopyConfig(NamedTuple):
    """One compiled variant of _copy_rows_kernel."""

    bits_dtype: torch.dtype  # torch.int32 or torch.int16
    has_src_ids: bool
    has_dst_ids: bool


def all_configs() -> list[CopyConfig]:
    """Every variant the three launchers can pick (ahead-of-time compile tests)."""
    modes = [(True, True), (True, False), (False, True)]
    return [CopyConfig(d, s, t) for d in (torch.int32, torch.int16) for s, t in modes]


@triton.jit(do_not_specialize=["row_numel"])
def _copy_rows_kernel(
    src_ptr,  # [*, row_numel]
    src_ids_ptr,  # [N] int64 (unused unless HAS_SRC_IDS)
    dst_ptr,  # [*, row_numel]
    dst_ids_ptr,  # [N] int64 (unused unless HAS_DST_IDS)
    row_numel,
    HAS_SRC_IDS: tl.constexpr,
    HAS_DST_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    src_row = i
    dst_row = i
    if HAS_SRC_IDS:
        src_row = tl.load(src_ids_ptr + i)
    if HAS_DST_IDS:
        dst_row = tl.load(dst_ids_ptr + i)
    src = src_ptr + src_row * row_numel
    dst = dst_ptr + dst_row * row_numel
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for chunk in range(tl.program_id(1), tl.cdiv(row_numel, BLOCK), tl.num_programs(1)):
        o = chunk * BLOCK + offs
        mask = o < row_numel
        tl.store(dst + o, tl.load(src + o, mask=mask), mask=mask)


def copy_rows_triton(
    src: torch.Tensor,  # [rows, ...] contiguous
    src_ids: torch.Tensor | None,  # [N] int64, or None: rows 0..N-1
    dst: torch.Tensor,  # [rows, ...] contiguous, same per-row shape and dtype as src
    dst_ids: torch.Tensor | None,  # [N] int64, or None: rows 0..N-1
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for i < N, one launch (CPU under TRITON_INTERPRET=1)."""
    n = (src_ids if src_ids is not None else dst_ids).shape[0]
    row_bytes = src[0].numel() * src.element_size()
    bits = torch.int32 if row_bytes % 4 == 0 else torch.int16
    src_rows = src.view(-1).view(torch.uint8).view(bits).view(src.shape[0], -1)
    dst_rows = dst.view(-1).view(torch.uint8).view(bits).view(dst.shape[0], -1)
    row_numel = src_rows.shape[1]
    chunks = min(triton.cdiv(row_numel, BLOCK), MAX_CHUNK_PROGRAMS)
    _copy_rows_kernel[(n, chunks)](
        src_rows, src_ids if src_ids is not None else src_rows, dst_rows,
        dst_ids if dst_ids is not None else dst_rows, row_numel,
        HAS_SRC_IDS=src_ids is not None, HAS_DST_IDS=dst_ids is not None, BLOCK=BLOCK, num_warps=4,
    )
