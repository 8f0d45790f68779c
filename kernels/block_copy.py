"""copy_blocks: the copy-on-write pairs of one step, whole blocks (all layers, K and V).

    kv_cache[dst[n]] = kv_cache[src[n]]    for n in 0..N-1, in one launch
"""

import torch

from kernels.checks import require, require_dtype, require_ids_in_range, require_same_device, require_shape
from kernels.dispatch import use_triton


def copy_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [N] int64
    dst: torch.Tensor,  # [N] int64
) -> None:
    """Copy block src[n] onto block dst[n] for every n, in place.

    dst ids must be distinct and disjoint from src ids (pairs are copied in parallel); ids
    are range-checked on CPU only. kv_cache must be contiguous. Raises ValueError.
    """
    check_pool(kv_cache)
    require_shape("src", src, (None,))
    require_shape("dst", dst, (src.shape[0],))
    require_dtype("src", src, torch.int64)
    require_dtype("dst", dst, torch.int64)
    require_same_device(kv_cache=kv_cache, src=src, dst=dst)
    require_ids_in_range("src", src, kv_cache.shape[0])
    require_ids_in_range("dst", dst, kv_cache.shape[0])
    if not kv_cache.is_cuda:
        dst_ids = dst.tolist()
        require(len(set(dst_ids)) == len(dst_ids), "dst: block ids must be distinct")
        require(not set(dst_ids) & set(src.tolist()), "dst: block ids must not also be sources")
    if src.numel() == 0:
        return
    if use_triton(kv_cache):
        from kernels.triton_block_copy import copy_rows_triton

        copy_rows_triton(kv_cache, src, kv_cache, dst)
    else:
        kv_cache.index_copy_(0, dst, kv_cache.index_select(0, src))


def check_pool(kv_cache: torch.Tensor) -> None:
    """kv_cache is a contiguous 6-d block-major pool."""
    require(kv_cache.dim() == 6 and kv_cache.shape[2] == 2,
            f"kv_cache: expected [num_blocks, num_layers, 2, block_size, H, D], got {tuple(kv_cache.shape)}")
    require(kv_cache.is_contiguous(), "kv_cache: must be contiguous (one block = one contiguous region)")
