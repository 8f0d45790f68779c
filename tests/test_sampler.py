"""The sampler alone: a row's filtering and draws do not depend on the rows batched with it."""
from __future__ import annotations

import torch

from engine import SamplingParams
from engine.sampler import Sampler, SamplingRow, _filter, choice_seed, draw_seed


def _row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [], [], params.get("seed"))


def test_an_unfiltered_row_is_untouched_beside_a_filtered_one():
    """top_p = 1 and no top_k keep every token, even batched with a top_k row over 32k tokens
    (a float32 cumsum over the whole vocabulary passes 1.0 and used to cut the tail)."""
    logits = torch.randn(2, 32000, generator=torch.Generator().manual_seed(0)) * 3
    out = _filter(logits, [_row(top_p=1.0), _row(top_k=40)])
    assert torch.equal(out[0], logits[0])
    assert int(torch.isfinite(out[1]).sum()) == 40


def test_seeded_draws_depend_on_seed_and_position_only():
    """The k-th draw of a seeded row is the same alone or batched with other rows; choice seeds
    wrap into int64 like the draws see them."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [], 7, draw=5)
    alone = Sampler()(logits[:1], [seeded])[0].token_id
    others = [SamplingRow(SamplingParams(temperature=1.0), [], [], None)] * 2
    assert Sampler(seed=3)(logits[[1, 0, 2]], [others[0], seeded, others[1]])[1].token_id == alone
    assert choice_seed(2 ** 63 - 1, 1) == -(2 ** 63)
    assert draw_seed(2 ** 63 - 1 + 1, 4) == draw_seed(-(2 ** 63), 4)


def test_draws_follow_the_distribution_and_never_pick_a_masked_token():
    """20,000 draws (in batches, shared and seeded generators) land on each token in proportion
    to its probability after temperature and top-k, and never on a token top-k removed."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    sampler, counts = Sampler(seed=1), torch.zeros(5)
    for k in range(200):
        rows = [_row(temperature=1.0, top_k=4)] * 50 + [
            SamplingRow(SamplingParams(temperature=1.0, top_k=4, seed=s), [], [], s, draw=k) for s in range(50)]
        for t in sampler(logits.repeat(100, 1), rows):
            counts[t.token_id] += 1
    expected = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.0]) / 0.97
    assert counts[4] == 0
    assert torch.allclose(counts / counts.sum(), expected, atol=0.012), counts / counts.sum()
