"""The paged KV pool: one tensor for all layers, block-major, so one block (every layer's K and
V) is one contiguous region — what the transfer ships as one frame.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
"""
from __future__ import annotations

import torch

from kernels import huge_pages
from engine.config import CacheConfig, ModelConfig


def block_bytes(model: ModelConfig, block_size: int) -> int:
    elem = torch.empty((), dtype=model.dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for(model: ModelConfig, cache: CacheConfig) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    return max(1, int(cache.kv_cache_gib * 2**30) // block_bytes(model, cache.block_size))


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device, world: int = 1) -> torch.Tensor:
    """The pool (of one tensor-parallel rank's share of the kv heads when world > 1), zeroed; on
    the CPU in huge pages where Linux gives them (kernels/huge_pages.py)."""
    shape = (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads // world, model.head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=model.dtype, device=device)
    return huge_pages.empty(shape, model.dtype).zero_()
