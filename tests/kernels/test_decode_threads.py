"""kernels/csrc/paged_decode.c gives a sequence's decode row the same bits on one thread and on
two (each task's sums run in a fixed order, whichever thread takes it) and alone or in any batch
(how its context is cut into segments depends on its own length only), with and without context
splits, every dtype."""
import pytest
import torch

from kernels import cpu_decode, paged_attention
from kernels.testing import make_paged_batch


def decode(b):
    return paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, b.scale,
                           b.max_seqlen_q, b.max_seqlen_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("min_segment", [256, 32])
def test_one_and_two_threads_give_the_same_bits(monkeypatch, dtype, min_segment):
    monkeypatch.setattr(cpu_decode, "MIN_SEGMENT", min_segment)     # 32: sequences of 64+ tokens split
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(dtype, threads):
    """Sequences up to 4,100 tokens (1 to 16 segments at the default MIN_SEGMENT), each alone, in
    the whole batch, and in a batch of two: a lone long sequence is split as it is among 32."""
    seq_lens = [4100, 7, 600, 300, 1500, 256, 255, 2048]
    b = make_paged_batch(seq_lens, [1] * len(seq_lens), 8, 2, 64, 16, dtype, "cpu")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = decode(b)
        for i in range(len(seq_lens)):
            for picked in ([i], [i, (i + 1) % len(seq_lens)]):
                lens = b.seq_lens[picked]
                alone = paged_attention(b.query[picked], b.k_cache, b.v_cache, b.block_tables[picked],
                                        torch.arange(len(picked) + 1, dtype=torch.int32), lens, b.scale, 1,
                                        int(lens.max()))
                assert torch.equal(alone[0], together[i]), (i, picked)
    finally:
        torch.set_num_threads(old)
