"""A prefill sequence's attention rows have the same bits whatever else is in its batch, on every
CPU path: the C kernel, torch's SDPA (kernels/cpu_prefill.py) and the path where no C kernel is
built. A greedy stream then gives the same tokens alone, beside other prompts, or moved to another
node, where its blocks were prefilled beside other prompts than on the first."""
import contextlib

import pytest
import torch

from kernels import paged_attention
from kernels.cpu_prefill import _fresh_groups
from kernels.testing import make_paged_batch, pytorch_attention

# (seq_lens, q_lens): sequence 0 is the one watched; beside it fresh prompts of its length and of
# others, a chunk after a cached prefix, a decode row
BATCHES = [
    ([200, 200, 200, 77, 9], [200, 200, 200, 77, 1]),
    ([300, 64, 300], [300, 64, 36]),
    ([260, 260, 1000], [60, 60, 1000]),
    ([12, 9, 7, 10], [12, 9, 7, 10]),
]


def _attention(b, rows: list[int]) -> torch.Tensor:
    """paged_attention of sequences `rows` of batch b alone (the same caches and block tables)."""
    cu = b.cu_seqlens_q.tolist()
    query = torch.cat([b.query[cu[i]:cu[i + 1]] for i in rows])
    q_lens = [cu[i + 1] - cu[i] for i in rows]
    cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = b.seq_lens[rows]
    return paged_attention(query, b.k_cache, b.v_cache, b.block_tables[rows], cu_q, seq_lens, b.scale,
                           max(q_lens), int(seq_lens.max()))


@pytest.mark.parametrize("path", ["default", "c", "sdpa", "no-c-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,q_lens", BATCHES)
def test_a_prefill_sequence_gets_the_same_bits_alone_and_in_any_batch(monkeypatch, path, dtype, seq_lens, q_lens):
    """On this CPU's own routing (an AVX2-only CPU: SDPA for all), forced to either, and with no
    C kernel at all."""
    if path == "default":
        monkeypatch.delenv("PDSERVE_PREFILL_SDPA", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_PREFILL_SDPA", {"c": "0", "sdpa": "1"}.get(path, "1"))
    b = make_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, dtype)
    with pytorch_attention() if path == "no-c-kernel" else contextlib.nullcontext():
        together = _attention(b, list(range(len(seq_lens))))
        alone = _attention(b, [0])
        reversed_ = _attention(b, list(range(len(seq_lens)))[::-1])
    q0 = q_lens[0]
    assert torch.equal(together[:q0], alone)
    assert torch.equal(reversed_[-q0:], alone)
    for i in range(1, len(seq_lens)):       # every other prefill sequence too, alone against in the batch
        if q_lens[i] == 1:
            continue                        # a decode row: kernels/cpu_decode.py's, not this file's
        start = sum(q_lens[:i])
        assert torch.equal(together[start:start + q_lens[i]], _attention(b, [i])), i


def test_sdpa_batches_only_fresh_prompts_of_one_length():
    cu = [0, 64, 128, 192, 200, 264, 328]      # q_lens 64, 64, 64, 8, 64, 64
    lens = [64, 64, 256, 8, 64, 100]
    assert _fresh_groups([0, 1, 2, 3, 4, 5], cu, lens) == [[0, 1, 4], [3], [2], [5]]
    assert _fresh_groups([], cu, lens) == []
