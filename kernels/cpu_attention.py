"""Paged attention on CPU tensors (no per-token Python loops).

1. decode rows (q_len == 1): the C kernel of kernels/cpu_decode.py, which reads K/V in place
   from the pool, when it is built and takes the tensors. Otherwise (the PyTorch path)
   sequences are sorted by length and taken in chunks; each chunk's K and V blocks are
   gathered by one `index_select` (see _gather) into a buffer that stays in cache while SDPA
   reads it, the GQA group is folded into SDPA's query-length dimension ([c, Hkv, G, D]
   against [c, Hkv, L, D]: no K/V expansion), and a length mask hides the padded tail.
2. prefill rows (q_len > 1, possibly after a cached prefix): one SDPA per sequence, causal
   mask offset by the cached prefix (is_causal=True when the whole sequence is new); GQA by
   a stride-0 expand of K/V.

SDPA gets 4-d inputs only: with 3-d inputs PyTorch 2.13 leaves its fast CPU kernel (~4x).
Few big ops rather than many small ones: each multi-threaded op is an OpenMP fork/join, and
on a loaded machine every join can wait a whole scheduler time slice for a preempted thread.
"""

import torch
import torch.nn.functional as F

from kernels import cpu_decode

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
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode and out.stride()[1:] == (query.shape[2], 1) and cpu_decode.supports(query, k_cache, v_cache):
        if len(decode) == len(lens):
            tables, dec_lens, rows = block_tables, seq_lens, cu_seqlens_q[:-1]
        else:
            pick = torch.tensor(decode)
            tables, dec_lens, rows = block_tables[pick], seq_lens[pick], cu_seqlens_q[pick]
        cpu_decode.paged_decode_c(out, query, k_cache, v_cache, tables, dec_lens, rows, scale)
    elif decode:
        _decode(out, query, k_cache, v_cache, block_tables, cu, lens, decode, scale)
    for i, n in enumerate(q_lens):
        if n > 1:
            q = query[cu[i] : cu[i + 1]]  # [q_len, H, D]
            out[cu[i] : cu[i + 1]] = _prefill_one(q, k_cache, v_cache, block_tables[i], lens[i], scale)
    return out


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
        ids = _block_ids(block_tables[part, :n_blk], part_lens, block_size)  # [c * n_blk]
        k, v = _gather(k_cache, v_cache, ids, kv_buf[: 2 * ids.numel()])  # [c * n_blk, bs, Hkv, D]
        shape = (len(part), n_blk * block_size, num_kv_heads, head_dim)
        k = k.view(shape)[:, :ctx].transpose(1, 2)  # [c, Hkv, ctx, D]
        v = v.view(shape)[:, :ctx].transpose(1, 2)
        q = query[rows[start : start + chunk]].view(len(part), num_kv_heads, group, head_dim)
        mask = None  # every sequence of the chunk is ctx long: no mask (a faster SDPA path)
        if lens[part[0]] != ctx:
            mask = (torch.arange(ctx) < part_lens[:, None])[:, None, None, :]  # [c, 1, 1, L]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))  # [c, Hkv, G, D]
    out.index_copy_(0, rows, torch.cat(outs).view(len(seqs), -1, head_dim))


def _block_ids(
    table: torch.Tensor,  # [c, n_blk] int32, may hold garbage past each sequence's blocks
    lens: torch.Tensor,  # [c]
    block_size: int,
) -> torch.Tensor:  # [c * n_blk] int64, padding entries replaced by block 0
    """Flattened block ids to gather; entries past a sequence's last block read block 0."""
    used = torch.arange(table.shape[1]) < (lens[:, None] + block_size - 1) // block_size
    return torch.where(used, table, 0).flatten().long()


def _prefill_one(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """Causal attention of one sequence's q_len newest rows over its seq_len cached tokens."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    q_len, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    ids = table[: -(-seq_len // block_size)].long()
    kv_shape = (num_kv_heads, group, seq_len, head_dim)
    k, v = _gather(k_cache, v_cache, ids, k_cache.new_empty((2 * ids.numel(), *k_cache.shape[1:])))
    k = k.flatten(0, 1)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
    v = v.flatten(0, 1)[:seq_len].transpose(0, 1)
    k, v = k[:, None].expand(kv_shape), v[:, None].expand(kv_shape)  # [Hkv, G, L, D], stride 0 on G
    qh = q.transpose(0, 1).view(num_kv_heads, group, q_len, head_dim)  # [Hkv, G, q_len, D]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos  # [q_len, L]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return o.view(num_heads, q_len, head_dim).transpose(0, 1)


def _gather(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    ids: torch.Tensor,  # [n] int64 block ids
    buf: torch.Tensor,  # [2n, block_size, num_kv_heads, head_dim], written
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V blocks: [n, block_size, num_kv_heads, head_dim]
    """Blocks ids of K and V, copied into buf (K first, then V).

    When both caches are row-aligned views of one pool (the kv_cache layout), one
    index_select over the pool seen as rows of block_size*H*D elements copies K and V:

        row r = storage[base + r*row : base + (r+1)*row]
        K of block b = row b*stride/row + k_off,  V of block b = row b*stride/row + v_off
    """
    n, row = ids.numel(), k_cache[0].numel()
    rows = _pool_rows(k_cache, v_cache)
    if rows is None:
        torch.index_select(k_cache, 0, ids, out=buf[:n])
        torch.index_select(v_cache, 0, ids, out=buf[n:])
    else:
        pool, step, k_off, v_off = rows
        torch.index_select(pool, 0, torch.cat([ids * step + k_off, ids * step + v_off]), out=buf.view(2 * n, row))
    return buf[:n], buf[n:]


def _pool_rows(k_cache, v_cache):
    """(pool as [rows, block_size*H*D], rows per block, K row, V row) or None if not aligned."""
    row = k_cache[0].numel()
    dense = (k_cache.shape[2] * k_cache.shape[3], k_cache.shape[3], 1)
    if (k_cache.stride()[1:] != dense or v_cache.stride() != k_cache.stride() or k_cache.stride(0) % row
            or v_cache.shape != k_cache.shape
            or k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr()):
        return None
    k_off, v_off = k_cache.storage_offset(), v_cache.storage_offset()
    base = min(k_off, v_off)
    if (k_off - base) % row or (v_off - base) % row:
        return None
    step = k_cache.stride(0) // row
    num_rows = (k_cache.shape[0] - 1) * step + max(k_off, v_off) // row - base // row + 1
    pool = k_cache.as_strided((num_rows, row), (row, 1), base)
    return pool, step, (k_off - base) // row, (v_off - base) // row
