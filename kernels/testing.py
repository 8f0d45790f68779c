"""Random paged batches for tests and benchmarks (not used on the serving path)."""

import contextlib
from typing import NamedTuple
from unittest import mock

import torch

# Written into block-table padding so that a kernel reading past seq_lens goes out of range.
GARBAGE_BLOCK_ID = 1 << 30


class PagedBatch(NamedTuple):
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], strided view
    query: torch.Tensor  # [T, num_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with garbage
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float
    max_seqlen_q: int
    max_seqlen_k: int


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_layers: int = 2,
    seed: int = 0,
) -> PagedBatch:
    """A batch whose sequences own randomly permuted blocks of a random multi-layer pool.

    The attention views are those of the last layer, so their block stride is not
    block_size*H*D. One spare column of garbage block ids pads every block table.
    """
    assert len(seq_lens) == len(q_lens) and all(q <= s for q, s in zip(q_lens, seq_lens))
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq, default=0) + 1
    table = torch.full((len(seq_lens), width), GARBAGE_BLOCK_ID, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn((int(cu[-1]), num_heads, head_dim), generator=g).to(dtype=dtype, device=device)
    return PagedBatch(
        kv_cache, kv_cache[:, -1, 0], kv_cache[:, -1, 1], query, table.to(device), cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), head_dim**-0.5,
        max(q_lens, default=0), max(seq_lens, default=0),
    )


@contextlib.contextmanager
def pytorch_attention():
    """Within it, CPU paged attention takes its PyTorch path (gather + SDPA) for decode and
    prefill rows, as on a host without a C compiler; the C kernels are not called."""
    from kernels import cpu_decode, cpu_prefill
    with mock.patch.object(cpu_decode, "supports", lambda *a: False), \
            mock.patch.object(cpu_prefill, "supports", lambda *a: False):
        yield


# Stated tolerances (max abs error; inputs ~N(0,1), outputs are convex mixes of V rows).
ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def run_and_compare(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, device):
    """paged_attention on a random batch against the plain-PyTorch reference, within ATOL; device
    "cpu-torch": the CPU's PyTorch path (pytorch_attention)."""
    from kernels import paged_attention
    from kernels.reference import paged_attention_ref
    torch_path = device == "cpu-torch"
    device = "cpu" if torch_path else device
    b = make_paged_batch(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, device)
    with pytorch_attention() if torch_path else contextlib.nullcontext():
        out = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens,
                              b.scale, b.max_seqlen_q, b.max_seqlen_k)
    ref = paged_attention_ref(b.query.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), b.block_tables.cpu(),
                              b.cu_seqlens_q.cpu(), b.seq_lens.cpu(), b.scale)
    assert out.dtype == dtype and out.shape == b.query.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATOL[dtype], rtol=0)
