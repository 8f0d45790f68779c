"""A decoder layer's small ops on CPU through the C kernels (kernels/csrc/layer_ops.c): RMSNorm
(optionally fused with the residual add), SiLU-and-mul, RoPE in place and the KV store. Each is
one call instead of several PyTorch ops, and at decode sizes it runs on the calling thread, where
PyTorch would wake its other OpenMP threads for each op.

Callers check `usable(...)` first (CPU, a supported dtype, contiguous rows, the library built);
the PyTorch paths in kernels/layer_ops.py, engine/rope.py and kernels/kv_store.py are the
fallback and the reference the tests compare against.
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import DTYPES, layer_ops_lib


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the C ops can take these tensors: all on the CPU in one supported dtype, each
    with contiguous rows (last dim stride 1), and the library built."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in DTYPES or layer_ops_lib() is None:
        return False            # (the device first: a CUDA run never builds the library)
    dtype = first.dtype
    for t in tensors:       # a plain loop: this runs several times per layer
        if t is not None and (t.dtype != dtype or t.device.type != "cpu" or t.stride(-1) != 1):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) per row of x [rows, n]; with `residual` [rows, n]: residual += x in
    place first, and the norm is of that sum."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    layer_ops_lib().rms_norm(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.contiguous().data_ptr(), out.data_ptr(),
        out.stride(0), rows, n, eps, DTYPES[x.dtype], torch.get_num_threads())
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [rows, 2n] = [gate | up]; returns [rows, n]."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype)
    layer_ops_lib().silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, n,
                             DTYPES[x.dtype], torch.get_num_threads())
    return out


def rotary_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate qk [rows, heads, head_dim] (heads contiguous in a row) in place by each row's
    position; cos/sin: [num_positions, head_dim] tables in qk's dtype. Raises IndexError for a
    position outside the table."""
    rows, heads, head_dim = qk.shape
    assert qk.stride(1) == head_dim and cos.is_contiguous() and sin.is_contiguous()
    positions = positions.to(torch.int64).contiguous()
    rc = layer_ops_lib().rotary(qk.data_ptr(), qk.stride(0), rows, heads, head_dim, positions.data_ptr(),
                                cos.data_ptr(), sin.data_ptr(), cos.shape[0], DTYPES[qk.dtype],
                                torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"rotary: a position lies outside the table of {cos.shape[0]} positions")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kernels.store_kv's CPU body, after its checks: rows of key/value [T, kv_heads, head_dim]
    (each row contiguous) into the cache views [num_blocks, block_size, kv_heads, head_dim],
    whose token rows are contiguous. Slot < 0: skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.contiguous()
    rc = layer_ops_lib().store_kv(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), slots.data_ptr(), key.shape[0], num_kv_heads * head_dim, block_size,
        num_blocks * block_size, key.element_size(), torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"store_kv: a slot lies outside the pool's {num_blocks * block_size} slots")


def rows_contiguous(t: torch.Tensor) -> bool:
    """A [T, heads, head_dim] tensor (or a pool view [blocks, block_size, heads, head_dim]) whose
    every token row of heads * head_dim elements is one contiguous run."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
