"""Triton store_kv (CUDA): one program per (token, kv head) copies one head_dim row.

    slot = slot_mapping[t]            (< 0: the program returns at once)
    k_cache[slot // block_size, slot % block_size, h, :] = key[t, h, :]     (same for V)

The copy is bit-exact and dtype-agnostic: the launcher views 2-byte dtypes as int16 and
4-byte ones as int32, so only the element size and HEAD_PAD select a compiled variant.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BITS_DTYPE = {2: torch.int16, 4: torch.int32}  # element size -> integer view


class StoreConfig(NamedTuple):
    """One compiled variant of _store_kv_kernel."""

    bits_dtype: torch.dtype  # torch.int16 or torch.int32
    head_pad: int  # HEAD_PAD: 64, 128 or 256


def all_configs() -> list[StoreConfig]:
    """Every variant the launcher can pick for head_dim <= 256 (ahead-of-time compile tests)."""
    return [StoreConfig(d, p) for d in BITS_DTYPE.values() for p in (64, 128, 256)]


def head_pad(head_dim: int) -> int:
    """HEAD_PAD: 64, 128 or 256 (few variants; the mask covers the rest)."""
    return max(64, triton.next_power_of_2(head_dim))


@triton.jit(do_not_specialize=["head_dim", "block_size"])
def _store_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [T] int64
    head_dim,
    block_size,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, HEAD_PAD)
    mask = d < head_dim
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + d, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + d, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Launch the copy (also runs on CPU tensors under TRITON_INTERPRET=1)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous (stride 1), got strides {t.stride()}")
    if head_dim > 256:
        raise ValueError(f"CUDA store_kv supports head_dim <= 256, got {head_dim}")
    bits = BITS_DTYPE[key.element_size()]
    key, value, k_cache, v_cache = (t.view(bits) for t in (key, value, k_cache, v_cache))
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping, head_dim, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_PAD=head_pad(head_dim), num_warps=1,
    )
