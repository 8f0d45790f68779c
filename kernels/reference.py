"""Plain-PyTorch references for every kernel: slow, simple, obviously correct.

Tests compare the CPU fast paths and the Triton kernels against these. Per-sequence and
per-token Python loops are fine here; speed is not a goal.

KV pool layout (one tensor for all layers, block-major):

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    k_cache = kv_cache[:, layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv_cache[:, layer, 1]
    slot = block_id * block_size + offset_in_block
"""

import torch


def store_kv_ref(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Write token t's K/V into slot slot_mapping[t] (in place); skip slots < 0."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t]
        v_cache[block, offset] = value[t]


def gather_sequence_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first seq_len cached tokens of one sequence, in position order."""
    block_size = cache.shape[1]
    rows = [cache[int(block_table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows)


def paged_attention_ref(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, includes this step's tokens
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim], query dtype
    """Causal attention of each sequence's new query rows over its paged cache.

    Query row j of sequence i (q_len = cu[i+1] - cu[i]) sits at position
    seq_lens[i] - q_len + j and attends to cache positions 0..that position.
    Computed in float32.
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[cu[i] : cu[i + 1]].float()  # [q_len, H, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k = gather_sequence_kv(k_cache, block_tables[i], seq_len).float()  # [L, Hkv, D]
        v = gather_sequence_kv(v_cache, block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [q_len, 1]
        k_pos = torch.arange(seq_len).unsqueeze(0)  # [1, L]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def copy_blocks_ref(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H, D]
    src: torch.Tensor,  # [N] int64
    dst: torch.Tensor,  # [N] int64
) -> None:
    """kv_cache[dst[n]] = kv_cache[src[n]] for every pair (all layers, K and V)."""
    for s, d in zip(src.tolist(), dst.tolist()):
        kv_cache[d] = kv_cache[s]


def gather_blocks_ref(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, num_layers, 2, block_size, H, D], contiguous
    """Pack the given blocks, in order, into one new contiguous tensor."""
    return torch.stack([kv_cache[b].clone() for b in block_ids.tolist()]) if len(block_ids) else (
        kv_cache.new_empty((0, *kv_cache.shape[1:]))
    )


def scatter_blocks_ref(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int64
    buffer: torch.Tensor,  # [n, num_layers, 2, block_size, H, D]
) -> None:
    """kv_cache[block_ids[i]] = buffer[i] for every i."""
    for i, b in enumerate(block_ids.tolist()):
        kv_cache[b] = buffer[i]
