"""kernels/csrc/paged_decode.c on one thread and on two: the same bits (each task's sums run in
a fixed order, whichever thread takes it), with and without context splits, every dtype."""
import pytest
import torch

from kernels import cpu_decode, paged_attention
from kernels.testing import make_paged_batch


def decode(b):
    return paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale,
                           b.max_seqlen_q, b.max_seqlen_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_one_and_two_threads_give_the_same_bits(monkeypatch, dtype, splits):
    monkeypatch.setattr(cpu_decode, "context_splits", lambda *a: splits)
    seq_lens = [1, 16, 17, 100, 300, 5, 64]
    b = make_paged_batch(seq_lens, [1] * len(seq_lens), 8, 2, 64, 16, dtype, "cpu")
    assert cpu_decode.supports(b.query, b.k_cache, b.v_cache)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(b)
        torch.set_num_threads(2)
        two = [decode(b) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert one.abs().sum() > 0
    for out in two:
        assert torch.equal(out, one)
