"""Paged attention on CPU tensors (no per-token Python loops).

1. decode rows (q_len == 1): the C kernel of kernels/cpu_decode.py, which reads K/V in place
   from the pool, when it is built and takes the tensors. Otherwise (the PyTorch path)
   sequences are sorted by length and taken in chunks; each chunk's K and V blocks are
   gathered by one `index_select` (cpu_gather.gather_kv) into a buffer that stays in cache
   while SDPA reads it, the GQA group is folded into SDPA's query-length dimension
   ([c, Hkv, G, D] against [c, Hkv, L, D]: no K/V expansion), and a length mask hides the
   padded tail.
2. prefill rows (q_len > 1, possibly after a cached prefix): kernels/cpu_prefill.py, causal
   SDPA over gathered K/V, similar sequences batched into one call.

SDPA gets 4-d inputs only: with 3-d inputs PyTorch 2.13 leaves its fast CPU kernel (~4x).
Few big ops rather than many small ones: each multi-threaded op is an OpenMP fork/join, and
on a loaded machine every join can wait a whole scheduler time slice for a preempted thread.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_decode
from kernels.checks import CheckMemo
from kernels.cpu_gather import additive_mask, block_ids, gather_kv
from kernels.cpu_prefill import prefill

# Target size in bytes of one chunk's gathered K (V is the same): small enough to stay in
# cache between the gather and SDPA, big enough to keep the number of ops low.
_CHUNK_BYTES = 4 << 20


def paged_attention_cpu(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Same contract as `kernels.paged_attention` for CPU tensors (inputs already checked)."""
    out = query.new_empty(query.shape)  # contiguous rows, whatever query's strides (the C kernel's contract)
    plan = _plan(block_tables, cu_seqlens_q, seq_lens)
    if plan.decode and cpu_decode.supports(query, k_cache, v_cache):
        cpu_decode.paged_decode_c(out, query, k_cache, v_cache, *plan.decode_c, scale)
    elif plan.decode:
        _decode(out, query, k_cache, v_cache, block_tables, plan.cu, plan.lens, plan.decode, scale)
    if plan.prefills:
        prefill(out, query, k_cache, v_cache, block_tables, plan.cu, plan.lens, plan.prefills, scale)
    return out


class _Plan(NamedTuple):
    """How one batch splits, worked out once per batch (the model's layers share it)."""
    cu: list[int]                 # cu_seqlens_q
    lens: list[int]               # seq_lens
    decode: list[int]             # sequences with one new token
    prefills: list[int]           # sequences with more
    decode_c: tuple               # the decode sequences' (tables, seq_lens, int64 rows), contiguous


_plans = CheckMemo()


def _plan(block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> _Plan:
    index = (block_tables, cu_seqlens_q, seq_lens)
    if _plans.seen(index, ()):
        return _plans.value
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decode) == len(lens):
        tables, dec_lens, rows = block_tables, seq_lens, cu_seqlens_q[:-1]
    else:
        pick = torch.tensor(decode, dtype=torch.long)
        tables, dec_lens, rows = block_tables[pick], seq_lens[pick], cu_seqlens_q[pick]
    decode_c = (tables.contiguous(), dec_lens.contiguous(), rows.to(torch.int64).contiguous())
    plan = _Plan(cu, lens, decode, [i for i, n in enumerate(q_lens) if n > 1], decode_c)
    _plans.remember(index, (), plan)
    return plan


def _decode(out, query, k_cache, v_cache, block_tables, cu, lens, seqs, scale) -> None:
    """Batched single-token attention for sequences `seqs`, written into out's rows."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    seqs = sorted(seqs, key=lambda i: lens[i])  # similar lengths share a chunk: less padding
    max_blocks = -(-lens[seqs[-1]] // block_size)
    block_bytes = block_size * num_kv_heads * head_dim * k_cache.element_size()
    chunk = max(1, _CHUNK_BYTES // (block_bytes * max_blocks))
    kv_buf = k_cache.new_empty((2 * min(chunk, len(seqs)) * max_blocks, block_size, num_kv_heads, head_dim))
    rows = torch.tensor([cu[i] for i in seqs])  # [n]: query/output row of each sorted sequence
    outs = []
    for start in range(0, len(seqs), chunk):
        part = seqs[start : start + chunk]
        part_lens = torch.tensor([lens[i] for i in part])  # [c]
        ctx = lens[part[-1]]  # sorted: the last is the longest
        n_blk = -(-ctx // block_size)
        ids = block_ids(block_tables[part, :n_blk], part_lens, block_size)  # [c * n_blk]
        k, v = gather_kv(k_cache, v_cache, ids, kv_buf[: 2 * ids.numel()])  # [c * n_blk, bs, Hkv, D]
        shape = (len(part), n_blk * block_size, num_kv_heads, head_dim)
        k = k.view(shape)[:, :ctx].transpose(1, 2)  # [c, Hkv, ctx, D]
        v = v.view(shape)[:, :ctx].transpose(1, 2)
        q = query[rows[start : start + chunk]].view(len(part), num_kv_heads, group, head_dim)
        mask = None  # every sequence of the chunk is ctx long: no mask (a faster SDPA path)
        if lens[part[0]] != ctx:
            mask = additive_mask((torch.arange(ctx) < part_lens[:, None])[:, None, None, :], q.dtype)  # [c, 1, 1, L]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))  # [c, Hkv, G, D]
    out.index_copy_(0, rows, torch.cat(outs).view(len(seqs), -1, head_dim))
