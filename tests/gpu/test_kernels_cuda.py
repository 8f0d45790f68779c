"""CUDA (Triton) kernels vs the reference over the configurations the launcher picks.

Skipped without a CUDA device; bench/gpu_check.sh runs it when a GPU is lent. The
unified-vs-split comparison pins split-K to the same answer as one pass.
"""

import pytest
import torch

from kernels import copy_blocks, gather_blocks, paged_attention, scatter_blocks, store_kv
from kernels.reference import paged_attention_ref
from kernels.testing import make_paged_batch
from kernels.triton_paged_attention import paged_attention_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _check(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, num_sms=None):
    b = make_paged_batch(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, "cuda")
    args = (b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale)
    out = paged_attention_triton(*args, b.max_seqlen_q, b.max_seqlen_k, num_sms=num_sms)
    ref = paged_attention_ref(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATOL[dtype], rtol=0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_mixed_batch_every_head_and_block_size(dtype, head_dim, block_size):
    """Mixed prefill / chunked prefill / decode batches are exact for every head and block size."""
    seq_lens = [1, block_size, 3 * block_size + 5, 300, 64, 129]
    q_lens = [1, block_size, 2, 300, 17, 1]
    _check(seq_lens, q_lens, 16, 4, head_dim, block_size, dtype)


@pytest.mark.parametrize("kv_heads", [32, 16, 8, 4, 1])
def test_gqa_ratios_up_to_mqa(kv_heads):
    """GQA ratios 1..32 (BLOCK_M 16 and 64) match the reference for decode and prefill."""
    _check([700, 1, 33, 90], [1, 1, 33, 40], 32, kv_heads, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("num_sms", [1, 132])
def test_long_context_decode_split_equals_unified(num_sms):
    """Split-K (num_sms=132 with a small batch) and one pass (num_sms=1) both match the reference."""
    _check([4096, 2500, 17], [1, 1, 1], 32, 8, 128, 16, torch.bfloat16, num_sms=num_sms)


def test_public_launcher_infers_max_seqlens():
    """paged_attention on CUDA without max_seqlen_q/k computes them and agrees with the reference."""
    b = make_paged_batch([40, 7], [40, 1], 8, 2, 64, 16, torch.float16, "cuda")
    out = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale)
    ref = paged_attention_ref(b.query.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), b.block_tables.cpu(),
                              b.cu_seqlens_q.cpu(), b.seq_lens.cpu(), b.scale)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATOL[torch.float16], rtol=0)


def test_large_block_moves_are_bit_exact():
    """store_kv, copy_blocks, gather and scatter on a 32-layer bf16 pool equal their CPU results."""
    pool = torch.randn(64, 32, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    expected = pool.cpu()
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    key, value = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16, device="cuda")
    store_kv(key, value, pool[:, 5, 0], pool[:, 5, 1], slots)
    store_kv(key.cpu(), value.cpu(), expected[:, 5, 0], expected[:, 5, 1], slots.cpu())
    src, dst = torch.arange(0, 10, device="cuda"), torch.arange(40, 50, device="cuda")
    copy_blocks(pool, src, dst)
    copy_blocks(expected, src.cpu(), dst.cpu())
    packed = gather_blocks(pool, dst)
    scatter_blocks(pool, torch.arange(20, 30, device="cuda"), packed)
    scatter_blocks(expected, torch.arange(20, 30), gather_blocks(expected, dst.cpu()))
    assert torch.equal(pool.cpu(), expected)
