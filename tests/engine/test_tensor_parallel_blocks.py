"""KV blocks between nodes carry every kv head: a tensor-parallel runner gathers its ranks' heads
of a block into one (the prefill side) and spreads a received block over them (the decode side)."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.block_manager import BlockCopy

PROMPT = [(i * 37) % 500 + 3 for i in range(21)]       # two full blocks and 5 tokens (block_size 8)
KWARGS = dict(block_size=8, num_blocks=32, max_num_batched_tokens=7)


class _Snapshots:
    """An engine observer: after each step that computed part of a prompt, that prompt's blocks
    with all heads, read as the prefill node's shipper reads them."""

    def __init__(self, read):
        self.read, self.taken = read, []

    def before_forward(self, scheduled) -> None:
        pass

    def on_computed(self, group, seq) -> None:
        self.taken.append(self.read(list(seq.block_table)))


def test_gathered_blocks_equal_a_tp1_pool(model_dir, make_llm):
    """After every 7-token prefill step, the prompt's blocks gathered from tp = 2's ranks equal
    tp = 1's pool blocks for the same prompt: all kv heads, in order, in a host copy."""
    path, _ = model_dir
    tp1, tp2 = make_llm(path, **KWARGS), make_llm(path, tensor_parallel_size=2, **KWARGS)
    whole = _Snapshots(lambda ids: tp1.engine.runner.kv_cache[ids].clone())
    gathered = _Snapshots(tp2.engine.runner.gather_blocks)
    tp1.engine.observer, tp2.engine.observer = whole, gathered
    params = SamplingParams(temperature=0.0, max_tokens=1)
    assert tp1.generate([PROMPT], params)[0].outputs[0].token_ids == \
        tp2.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(gathered.taken) == len(whole.taken) == 3                  # 21 tokens in 7-token steps
    for got, want in zip(gathered.taken, whole.taken):
        assert got.shape == want.shape == (3, 2, 2, 8, 2, 16)            # 2 kv heads: both ranks'
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert gathered.taken[-1].abs().sum() > 0
    assert not torch.equal(gathered.taken[-1][..., 0, :], gathered.taken[-1][..., 1, :])


def test_written_blocks_reach_each_rank_before_later_ops(model_dir, make_llm):
    """Full-head blocks written into a tp = 2 pool land on rank 0 at once and on the worker with
    the next message, ahead of a later copy of them: gathered back (the copy too) they are the
    same bytes, also after a step; a block of the wrong shape or dtype is refused."""
    path, _ = model_dir
    llm = make_llm(path, tensor_parallel_size=2, **KWARGS)
    runner = llm.engine.runner
    blocks = torch.randn((2,) + tuple(runner.kv_cache.shape[1:4]) + (2, 16))   # [2, L, 2, bs, H, D]
    runner.write_blocks([29, 30], blocks)
    torch.testing.assert_close(runner.kv_cache[[29, 30]], blocks[..., :1, :], rtol=0, atol=0)
    runner.copy_blocks([BlockCopy(29, 31)])
    expected = torch.stack([blocks[0], blocks[1], blocks[0]])
    assert torch.equal(runner.gather_blocks([29, 30, 31]), expected)
    runner.write_blocks([31], blocks[1:])                 # now replayed with a step's message
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    assert torch.equal(runner.gather_blocks([29, 30, 31]), blocks[[0, 1, 1]])
    with pytest.raises(ValueError, match="write_blocks takes"):
        runner.write_blocks([28], blocks[:1, ..., :1, :])
    with pytest.raises(ValueError, match="write_blocks takes"):
        runner.write_blocks([28], blocks[:1].double())
