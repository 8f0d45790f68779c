"""Decode rows of CPU paged attention through the C kernel (kernels/csrc/paged_decode.c), which
reads K and V in place from the pool: no gathered copy of the context, unlike the SDPA path.
On the bench workload (32 sequences, context 128-256, fp32) attention per decode step went
from 16 ms (gather + SDPA) to a few ms; `python bench/attention_cpu.py` has the figures."""
from __future__ import annotations

import torch

from kernels.cpu_kernels import DTYPES, paged_decode_lib


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernel can take these tensors (dtype, head rows contiguous, K/V alike)."""
    return layout_ok(query, k_cache, v_cache) and paged_decode_lib() is not None


def layout_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The layout the C attention kernels read: one dtype they know, each query row's heads
    contiguous, each cached token's kv heads one contiguous row, K and V strided alike."""
    head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
    return (query.dtype in DTYPES and k_cache.dtype == query.dtype
            and query.stride(2) == 1 and query.stride(1) == head_dim
            and k_cache.stride()[2:] == (head_dim, 1) and k_cache.stride(1) == num_kv_heads * head_dim
            and v_cache.stride() == k_cache.stride())


def paged_decode_c(
    out: torch.Tensor,  # [T, num_heads, head_dim], rows `rows` written
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    rows: torch.Tensor,  # [num_seqs] int64: each sequence's query/output row
    scale: float,
) -> None:
    """One query token per listed sequence (callers check `supports` and the index ranges)."""
    tables, lens, rows = block_tables.contiguous(), seq_lens.contiguous(), rows.to(torch.int64).contiguous()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rc = paged_decode_lib().paged_decode(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), tables.data_ptr(), tables.stride(0), lens.data_ptr(), rows.data_ptr(),
        out.data_ptr(), out.stride(0), rows.numel(), query.shape[1], num_kv_heads, head_dim, block_size,
        scale, DTYPES[query.dtype], torch.get_num_threads(), MAX_SPLITS, MIN_SEGMENT)
    if rc != 0:
        raise MemoryError("paged_decode: could not allocate its scratch memory")


# The C kernel cuts a sequence of L tokens into min(max(L // MIN_SEGMENT, 1), MAX_SPLITS) segments,
# merged after (flash-decoding). The sequence's own length alone decides, not the batch or the
# thread count, so its output has the same bits in any batch and on any node.
MIN_SEGMENT = 256    # tokens: below this a segment's merge and task costs outweigh its reads
MAX_SPLITS = 16      # a lone 4,096-token sequence: 16 tasks, 8 for each of 2 threads, 1 for each of 16
