"""The sampler alone: a row's filtering and draws do not depend on the rows batched with it."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.logit_filter import _sorted_filter, filter_logits
from engine.sampler import Sampler, SamplingRow, _filter, draw_seed
from pdwire.sampling_params import choice_seed


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
    seeded = SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [0] * 5, 7)     # draw 5
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
            SamplingRow(SamplingParams(temperature=1.0, top_k=4, seed=s), [], [0] * k, s) for s in range(50)]
        for t in sampler(logits.repeat(100, 1), rows):
            counts[t.token_id] += 1
    expected = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.0]) / 0.97
    assert counts[4] == 0
    assert torch.allclose(counts / counts.sum(), expected, atol=0.012), counts / counts.sum()


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
def test_candidate_filter_drops_what_the_full_sort_drops(scale):
    """Over flat (scale 1: most rows fall back to the full sort) and peaked (scale 12: every row
    is decided by its 256 candidates) logits, every mix of top-k, top-p and min-p keeps exactly
    the tokens a sort of the whole row keeps."""
    g = torch.Generator().manual_seed(int(scale))
    rows = 96
    logits = torch.randn(rows, 32000, generator=g) * scale
    top_k = torch.tensor([[32000, 1, 50, 256, 300, 5000, 31999, 40][i % 8] for i in range(rows)])
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.99][(i // 8) % 4] for i in range(rows)])
    min_p = torch.tensor([[0.0, 0.05, 0.3][(i // 32) % 3] for i in range(rows)])
    fast = filter_logits(logits, top_k, top_p, min_p)
    full = _sorted_filter(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(fast), torch.isinf(full))
    assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])


def test_greedy_over_bf16_logits_picks_the_float32_argmax():
    """A bf16 model's logits, uncast: greedy rows get float32's argmax (first of equal maxima),
    alone (the argmax-only path), beside a sampled row, with logprobs (the float32 path), and a
    banned maximum is still skipped."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-4, 4, (6, 3000), generator=g).to(torch.bfloat16)     # many ties
    expected = logits.float().argmax(dim=-1).tolist()
    greedy = [_row(temperature=0.0)] * 6
    assert [t.token_id for t in Sampler()(logits, greedy)] == expected
    mixed = Sampler()(logits, greedy[:5] + [_row(temperature=1.0)])
    assert [t.token_id for t in mixed[:5]] == expected[:5]
    with_logprobs = Sampler()(logits, [_row(temperature=0.0, logprobs=2)] * 6)
    assert [t.token_id for t in with_logprobs] == expected
    lp = torch.log_softmax(logits.float(), dim=-1)
    assert with_logprobs[0].logprobs[expected[0]] == pytest.approx(float(lp[0, expected[0]]))
    banned = SamplingRow(SamplingParams(temperature=0.0), [], [], None, banned_ids=(expected[0],))
    assert Sampler()(logits[:1], [banned])[0].token_id == logits[0].float().index_fill(
        0, torch.tensor([expected[0]]), float("-inf")).argmax().item()


def test_argmax_only_is_greedy_with_nothing_that_edits_or_scores_the_logits():
    """SamplingRow.argmax_only, the one statement of the rule: greedy, no penalties, no banned
    ids, no grammar, no logprobs; each of them alone takes it away."""
    assert _row(temperature=0.0).argmax_only
    edited = [_row(temperature=0.0, repetition_penalty=1.2), _row(temperature=0.0, presence_penalty=0.5),
              SamplingRow(SamplingParams(temperature=0.0), [], [], None, banned_ids=(3,)),
              SamplingRow(SamplingParams(temperature=0.0), [], [], None, grammar=object())]
    assert [(r.edits_logits, r.argmax_only) for r in edited] == [(True, False)] * 4
    others = [_row(temperature=0.0, logprobs=0), _row(temperature=1.0)]
    assert [(r.edits_logits, r.argmax_only) for r in others] == [(False, False)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_and_banned_ids_leave_the_callers_logits_as_they_were(dtype):
    """The penalty / banned-id path edits its own float32 copy in place: the logits passed in are
    unchanged (float32 ones are not cast, so only the copy keeps them safe), and the token is the
    argmax of the edited row."""
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(9)).to(dtype)
    before = logits.clone()
    best = int(logits[0].float().argmax())
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], None, banned_ids=(best,)),
            SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [best], [], None)]
    got = [t.token_id for t in Sampler()(logits, rows)]
    assert torch.equal(logits, before)
    edited = logits.float().clone()
    edited[0, best] = float("-inf")
    edited[1, best] = torch.where(edited[1, best] > 0, edited[1, best] / 2.0, edited[1, best] * 2.0)
    assert got == edited.argmax(dim=-1).tolist()
