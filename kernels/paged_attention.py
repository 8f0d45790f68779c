"""paged_attention: unified varlen attention over the paged KV cache (vLLM v1 style).

One flattened batch mixes prefill chunks and decode tokens. Sequence i owns query rows
cu_seqlens_q[i]:cu_seqlens_q[i+1]; its cache already holds seq_lens[i] tokens, this step's
included (store_kv ran first):

    cache positions  0 ........................ ctx-1 | ctx ........ seq_len-1
                     [ cached prefix (ctx tokens)    ] [ this step: q_len rows ]
    query row j sits at position ctx + j and attends to positions 0..ctx+j

Dispatch: CUDA tensors -> Triton (kernels/triton_paged_attention.py); CPU tensors ->
plain PyTorch (kernels/cpu_attention.py).
"""

import torch

from kernels.checks import FLOAT_DTYPES, CheckMemo, require, require_dtype, require_same_device, require_shape
from kernels.cpu_attention import paged_attention_cpu
from kernels.dispatch import use_triton

_checked = CheckMemo()


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, includes this step's tokens
    scale: float,
    max_seqlen_q: int | None = None,  # host-side max q_len; computed (a sync) if None
    max_seqlen_k: int | None = None,  # host-side max seq_len; computed (a sync) if None
) -> torch.Tensor:  # [T, num_heads, head_dim], query dtype
    """Causal paged attention for every query row; float32 accumulation.

    num_heads must be a multiple of num_kv_heads (GQA/MQA). Block-table entries past
    ceil(seq_lens[i] / block_size) are never read. Raises ValueError on bad shapes, dtypes,
    devices and (for CPU tensors) bad index values.
    """
    index = (block_tables, cu_seqlens_q, seq_lens)
    meta = tuple((t.shape, t.dtype, t.device) for t in (query, k_cache, v_cache))
    if not _checked.seen(index, meta):
        _check_shapes(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
        if not query.is_cuda:
            _check_values(query, k_cache, block_tables, cu_seqlens_q, seq_lens)
        _checked.remember(index, meta)
    if not use_triton(query):
        return paged_attention_cpu(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    from kernels.triton_paged_attention import paged_attention_triton

    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if seq_lens.numel() else 0
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max()) if seq_lens.numel() else 0
    return paged_attention_triton(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                  scale, max_seqlen_q, max_seqlen_k)


def unsupported_attention(head_dim: int, num_heads: int, num_kv_heads: int, device: torch.device) -> str | None:
    """Why paged attention cannot run a model of these heads on this device, or None. The CPU
    path takes any shape; the Triton kernels have compiled variants for some head sizes only."""
    if device.type != "cuda":
        return None
    from kernels.triton_paged_attention import unsupported

    return unsupported(head_dim, num_heads // num_kv_heads)


def _check_shapes(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    require(k_cache.dim() == 4, f"k_cache: expected 4 dims, got shape {tuple(k_cache.shape)}")
    _, _, num_kv_heads, head_dim = k_cache.shape
    require(query.dim() == 3, f"query: expected [T, num_heads, head_dim], got {tuple(query.shape)}")
    require_shape("query", query, (None, None, head_dim))
    require(query.shape[1] % num_kv_heads == 0,
            f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    require_shape("v_cache", v_cache, tuple(k_cache.shape))
    require(block_tables.dim() == 2, f"block_tables: expected 2 dims, got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    require_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    require_shape("seq_lens", seq_lens, (num_seqs,))
    require_dtype("query", query, *FLOAT_DTYPES)
    require_dtype("k_cache", k_cache, query.dtype)
    require_dtype("v_cache", v_cache, query.dtype)
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        require_dtype(name, t, torch.int32)
    require_same_device(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                        cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)


def _check_values(query, k_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    """Index ranges (CPU tensors only: on CUDA these would cost a device sync)."""
    num_blocks, block_size = k_cache.shape[:2]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    require(int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == query.shape[0],
            f"cu_seqlens_q must run from 0 to T={query.shape[0]}")
    require(bool((q_lens >= 0).all()), "cu_seqlens_q must be non-decreasing")
    require(bool((seq_lens >= q_lens).all()), "seq_lens[i] must be >= the query length of sequence i")
    n_blocks = (seq_lens + block_size - 1) // block_size
    require(bool((n_blocks <= block_tables.shape[1]).all()), "block_tables too narrow for seq_lens")
    used = block_tables[torch.arange(block_tables.shape[1]) < n_blocks[:, None]]
    if used.numel():
        lo, hi = int(used.min()), int(used.max())
        require(0 <= lo and hi < num_blocks, f"block_tables: ids must lie in [0, {num_blocks}), got [{lo}, {hi}]")
