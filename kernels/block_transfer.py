"""gather_blocks / scatter_blocks: pack blocks for sending, unpack a received buffer.

    gather:  buffer[i] = kv_cache[block_ids[i]]     (new contiguous tensor)
    scatter: kv_cache[block_ids[i]] = buffer[i]     (in place)
"""

import torch

from kernels.block_copy import check_pool
from kernels.checks import require, require_dtype, require_ids_in_range, require_same_device, require_shape
from kernels.dispatch import use_triton


def gather_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, num_layers, 2, block_size, H, D], contiguous
    """Pack blocks block_ids (in order) into a new contiguous tensor. Raises ValueError."""
    _check_ids(kv_cache, block_ids)
    if not use_triton(kv_cache):
        return kv_cache.index_select(0, block_ids)
    buffer = kv_cache.new_empty((block_ids.shape[0], *kv_cache.shape[1:]))
    if block_ids.numel():
        from kernels.triton_block_copy import copy_rows_triton

        copy_rows_triton(kv_cache, block_ids, buffer, None)
    return buffer


def scatter_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int64, distinct
    buffer: torch.Tensor,  # [n, num_layers, 2, block_size, H, D]
) -> None:
    """Unpack buffer[i] into block block_ids[i], in place. Raises ValueError."""
    _check_ids(kv_cache, block_ids)
    require_shape("buffer", buffer, (block_ids.shape[0], *kv_cache.shape[1:]))
    require_dtype("buffer", buffer, kv_cache.dtype)
    require_same_device(kv_cache=kv_cache, buffer=buffer)
    require(buffer.is_contiguous(), "buffer: must be contiguous")
    if not kv_cache.is_cuda:
        ids = block_ids.tolist()
        require(len(set(ids)) == len(ids), "block_ids: must be distinct")
    if not use_triton(kv_cache):
        kv_cache.index_copy_(0, block_ids, buffer)
    elif block_ids.numel():
        from kernels.triton_block_copy import copy_rows_triton

        copy_rows_triton(buffer, None, kv_cache, block_ids)


def _check_ids(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    check_pool(kv_cache)
    require_shape("block_ids", block_ids, (None,))
    require_dtype("block_ids", block_ids, torch.int64)
    require_same_device(kv_cache=kv_cache, block_ids=block_ids)
    require_ids_in_range("block_ids", block_ids, kv_cache.shape[0])
