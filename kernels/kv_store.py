"""store_kv ("reshape and cache"): write this step's K/V rows into their paged slots.

    slot = block_id * block_size + offset_in_block      (slot -1: skip the token)
    k_cache[slot // block_size, slot % block_size] = key[t]
"""

import torch

from kernels import cpu_layer_ops
from kernels.checks import FLOAT_DTYPES, CheckMemo, require, require_dtype, require_same_device, require_shape
from kernels.dispatch import use_triton

_checked = CheckMemo()


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Write key[t]/value[t] into slot slot_mapping[t] of k_cache/v_cache, in place, one launch.

    Slots >= 0 must be distinct and < num_blocks * block_size (range checked on CPU only);
    key/value must have the cache's dtype. Raises ValueError on bad arguments.
    """
    meta = tuple((t.shape, t.dtype, t.device) for t in (key, value, k_cache, v_cache))
    if not _checked.seen((slot_mapping,), meta):
        _check(key, value, k_cache, v_cache, slot_mapping)
        _checked.remember((slot_mapping,), meta)
    if key.shape[0] == 0:
        return
    if use_triton(key):
        from kernels.triton_kv_store import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        _store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    require(k_cache.dim() == 4, f"k_cache: expected 4 dims, got shape {tuple(k_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = key.shape[0] if key.dim() == 3 else -1
    require_shape("key", key, (None, num_kv_heads, head_dim))
    require_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    require_shape("v_cache", v_cache, tuple(k_cache.shape))
    require_shape("slot_mapping", slot_mapping, (num_tokens,))
    require_dtype("k_cache", k_cache, *FLOAT_DTYPES)
    for name, t in (("key", key), ("value", value), ("v_cache", v_cache)):
        require_dtype(name, t, k_cache.dtype)
    require_dtype("slot_mapping", slot_mapping, torch.int64)
    require_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if not key.is_cuda and num_tokens > 0:
        hi = int(slot_mapping.max())
        require(hi < num_blocks * block_size, f"slot_mapping: slot {hi} >= {num_blocks * block_size} slots")


def _store_kv_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """One C call (kernels/csrc/layer_ops.c) when every token row is contiguous; else an
    advanced-index write straight into the strided cache views."""
    if (cpu_layer_ops.usable(key, value, k_cache, v_cache) and v_cache.stride() == k_cache.stride()
            and all(cpu_layer_ops.rows_contiguous(t) for t in (key, value, k_cache, v_cache))):
        cpu_layer_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_size = k_cache.shape[1]
    index = (slot_mapping // block_size, slot_mapping % block_size)
    k_cache.index_put_(index, key)
    v_cache.index_put_(index, value)
