"""Triton unified paged attention (CUDA): prefill chunks and decode tokens in one launch.

Grid: (query blocks, kv heads, segments). A program owns BLOCK_M rows = BLOCK_Q query tokens
of one sequence x the GROUP query heads sharing one kv head, so a decode token's GQA group
fills the rows of one tl.dot. Query block b belongs to the last sequence i with
cu_seqlens_q[i] // BLOCK_Q + i <= b (binary search); the grid has T // BLOCK_Q + num_seqs
blocks, enough for every sequence, and spare programs exit at once.

    rows of a program (GROUP = 2, BLOCK_Q = 8, BLOCK_M = 16):
    m:      0  1  2  3  4 ... 14 15
    token:  t  t  t+1 t+1   ... t+7 t+7
    head:   2h 2h+1 2h 2h+1 ... 2h 2h+1

The program walks the sequence's cache in tiles of TILE_N positions (a tile may span
several blocks: each position looks up its own block), online softmax in float32 with exp2.
split (flash-decoding, a runtime flag): the tiles of a sequence are cut into num_segments
ranges, one per program along grid axis 2; each writes an unnormalized partial (acc, max, sum) and
_reduce_segments_kernel merges them.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
HEAD_DIMS = (32, 64, 80, 96, 128)  # head sizes with a compiled (and compile-tested) variant;
# 32 is the built-in model's
MAX_GROUP = 64  # query heads per kv head that one program's BLOCK_M = 64 rows can hold
TILE_N = 32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PRECISION = "ieee"  # tl.dot on fp32 inputs: exact products, not tf32 (no effect on fp16/bf16)


class AttentionConfig(NamedTuple):
    """One compiled variant of _paged_attention_kernel (what the launcher picks)."""

    dtype: torch.dtype  # query / cache / output dtype
    head_dim: int  # HEAD_DIM, one of HEAD_DIMS (HEAD_PAD = head_pad(head_dim))
    block_m: int  # BLOCK_M: 16 (decode, GQA group <= 16) or 64 (prefill, or larger groups)
    num_warps: int = 4
    num_stages: int = 2


def pick_config(dtype: torch.dtype, head_dim: int, group: int, max_seqlen_q: int) -> AttentionConfig:
    """The variant for a batch (split-K is a runtime choice: pick_num_segments)."""
    block_m = 16 if max_seqlen_q <= 1 and group <= 16 else 64
    return AttentionConfig(dtype, head_dim, block_m)


def pick_num_segments(config: AttentionConfig, num_seqs: int, num_kv_heads: int, max_seqlen_q: int,
                      max_seqlen_k: int, num_sms: int) -> int:
    """Split-K segments: > 1 only for pure-decode batches too small to fill the GPU with long
    contexts; aims at ~2 programs per SM with >= 4 tiles of TILE_N per segment."""
    programs = num_seqs * num_kv_heads
    if max_seqlen_q != 1 or config.block_m != 16 or programs >= num_sms:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    most = max(1, max_seqlen_k // (4 * TILE_N))
    return max(1, min(wanted, triton.next_power_of_2(most + 1) // 2, 64))


def head_pad(head_dim: int) -> int:
    """HEAD_PAD: the next power of two (tl.dot needs >= 16); masks cover the padding."""
    return max(16, triton.next_power_of_2(head_dim))


def all_configs() -> list[AttentionConfig]:
    """Every variant pick_config / pick_num_segments can produce (for ahead-of-time compile tests)."""
    return [AttentionConfig(dtype, d, block_m) for dtype in DTYPES for d in HEAD_DIMS for block_m in (16, 64)]


@triton.jit
def _find_sequence(cu_q_ptr, q_block, num_seqs, block_q):
    """Largest i with cu_q[i] // block_q + i <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // block_q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Scalars that may equal 1: Triton would make them constexpr (a different compiled variant
# from the one tests/kernels/test_kernels_triton_compile.py builds), so they stay plain int32.
_RUNTIME_INTS = ["num_seqs", "num_heads", "group", "block_q", "block_size", "num_segments", "split"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]                      (split = 0)
    seg_acc_ptr,  # [T, num_heads, num_segments, HEAD_PAD] f32 (split = 1)
    seg_max_ptr,  # [T, num_heads, num_segments] f32, log2 domain
    seg_sum_ptr,  # [T, num_heads, num_segments] f32
    q_ptr,  # [T, num_heads, head_dim]
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    group,  # query heads per kv head
    block_q,  # query tokens per program = BLOCK_M // group
    block_size,
    num_segments,
    split,  # 0: write out; 1: write segment partials (num_segments >= 1)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" keeps fp32 exact
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_sequence(cu_q_ptr, q_block, num_seqs, block_q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local = q_block - (q_start // block_q + seq)
    if local * block_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_idx = local * block_q + offs_m // group  # [BLOCK_M] query token within the sequence
    head = kv_head * group + offs_m % group  # [BLOCK_M]
    row_ok = (offs_m < block_q * group) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    q_pos = context + q_idx  # [BLOCK_M] absolute position of each row

    kv_end = context + tl.minimum(local * block_q + block_q, q_len)  # last row's position + 1
    num_tiles = tl.cdiv(kv_end, TILE_N)
    per_segment = tl.cdiv(num_tiles, num_segments)  # num_segments == 1 unless split
    tile_lo = segment * per_segment
    tile_hi = tl.minimum(tile_lo + per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n  # [TILE_N]
        pos_ok = pos < kv_end
        block = tl.load(table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        in_block = pos % block_size
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [TILE_N]
        k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None],
                    mask=pos_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE_N]
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay finite
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh  # [TILE_N]
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :],
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if split:
        part = (token * num_heads + head) * num_segments + segment  # [BLOCK_M]
        tl.store(seg_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(seg_max_ptr + part, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + part, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_heads", "num_segments"])
def _reduce_segments_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    seg_acc_ptr,  # [T, num_heads, num_segments, HEAD_PAD] f32
    seg_max_ptr,  # [T, num_heads, num_segments] f32
    seg_sum_ptr,  # [T, num_heads, num_segments] f32
    num_heads,
    num_segments,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """out[t, h] = merge of the segment partials of row (t, h); one program per row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_PAD)
    base = (token * num_heads + head) * num_segments
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for s in range(num_segments):
        m_s = tl.load(seg_max_ptr + base + s)
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_safe)
        b = tl.exp2(m_s - m_safe)
        l = l * a + tl.load(seg_sum_ptr + base + s) * b
        acc = acc * a + tl.load(seg_acc_ptr + (base + s) * HEAD_PAD + offs_d) * b
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def unsupported(head_dim: int, group: int) -> str | None:
    """Why these kernels have no variant for this head shape (group: query heads per kv head)."""
    if head_dim in HEAD_DIMS and group <= MAX_GROUP:
        return None
    return (f"the CUDA paged-attention kernels take head_dim in {HEAD_DIMS} and at most {MAX_GROUP} "
            f"query heads per kv head; got head_dim {head_dim} and {group}")


def paged_attention_triton(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_sms: int | None = None,  # SMs to fill; None: the device's count (tests pass one for CPU)
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Launch (no device sync): one unified pass, or split-K pass + merge for small decode batches.

    Also runs on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if (reason := unsupported(head_dim, group)) is not None:
        raise ValueError(reason)
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous (stride 1), got strides {t.stride()}")
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    config = pick_config(query.dtype, head_dim, group, max_seqlen_q)
    if num_sms is None:     # interpreted on CPU tensors (tests): one pass unless a test asks
        num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 1
    segments = pick_num_segments(config, num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, num_sms)
    split = segments > 1
    f32 = dict(device=query.device, dtype=torch.float32)
    if split:
        seg_acc = torch.empty((num_tokens, num_heads, segments, head_pad(head_dim)), **f32)
        seg_max = torch.empty((num_tokens, num_heads, segments), **f32)
        seg_sum = torch.empty((num_tokens, num_heads, segments), **f32)
    else:
        seg_acc = seg_max = seg_sum = torch.empty(1, **f32)
    block_q = config.block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, segments)
    _paged_attention_kernel[grid](
        out, seg_acc, seg_max, seg_sum, query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2E, num_seqs, num_heads, group, block_q, k_cache.shape[1], segments, int(split),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad(head_dim), BLOCK_M=config.block_m, TILE_N=TILE_N,
        PRECISION=PRECISION,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, seg_acc, seg_max, seg_sum, num_heads, segments, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad(head_dim), num_warps=1,
        )
    return out

