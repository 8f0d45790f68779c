"""Benchmark workloads and arrivals: reproducible by seed, on their target lengths and rates."""
import numpy as np
import pytest

from bench.serving.arrivals import achieved_rate, arrival_times
from bench.serving.workloads import ALPACA, SHAREGPT, WORKLOADS, WorkloadSpec, generate, summary


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests(name):
    """A workload is a pure function of (name, size, seed): same seed equal, other seed different."""
    spec = WorkloadSpec(name, 50, seed=7)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(WorkloadSpec(name, 50, seed=8))


@pytest.mark.parametrize("name", WORKLOADS)
def test_requests_fit_the_context(name):
    """Every prompt + output fits max_model_len, lengths >= 1, ids are word tokens (>= 3)."""
    for r in generate(WorkloadSpec(name, 300, max_model_len=2048)):
        assert 1 <= r.prompt_len and 1 <= r.output_len and r.prompt_len + r.output_len <= 2048
        assert min(r.prompt_ids) >= 3 and max(r.prompt_ids) < 32000


@pytest.mark.parametrize("lengths,prompt_mean,output_mean", [(SHAREGPT, 161, 338), (ALPACA, 19, 58)])
def test_length_models_have_the_papers_means(lengths, prompt_mean, output_mean):
    """Unclipped draws average the vLLM paper's means within 2%."""
    rng = np.random.default_rng(0)
    assert lengths[0].sample(rng, 200_000, 1, 10**9).mean() == pytest.approx(prompt_mean, rel=0.02)
    assert lengths[1].sample(rng, 200_000, 1, 10**9).mean() == pytest.approx(output_mean, rel=0.02)


@pytest.mark.parametrize("name,prompt_mean,output_mean", [("sharegpt", 161, 338), ("alpaca", 19, 58)])
def test_workload_means_after_clipping(name, prompt_mean, output_mean):
    """The clipped workloads stay within 8% of the target means."""
    s = summary(generate(WorkloadSpec(name, 4000)))
    assert s["prompt_mean"] == pytest.approx(prompt_mean, rel=0.08)
    assert s["output_mean"] == pytest.approx(output_mean, rel=0.08)


def test_rag_shares_few_long_documents():
    """RAG prompts start with one of 4 documents of 2k-8k tokens scaled to the context."""
    reqs = generate(WorkloadSpec("rag", 200, max_model_len=4096))
    heads = {r.prompt_ids[:1024] for r in reqs}
    assert len(heads) <= 4
    assert all(1024 <= r.prompt_len <= 4096 - 256 + 64 for r in reqs)
    firsts = [r.prompt_ids[:1024] for r in reqs if r.kind == "rag-first"]     # each document's first use
    assert sorted(firsts) == sorted(heads) and reqs[0].kind == "rag-first"


def test_prefix_workload_shares_system_prompts():
    """Prefix prompts start with one of 4 shared 512-token system prompts."""
    reqs = generate(WorkloadSpec("prefix", 200))
    assert len({r.prompt_ids[:512] for r in reqs}) == 4


def test_mixed_has_about_ten_percent_long_prompts():
    """Mixed: ~10% long unique prompts among chats."""
    kinds = summary(generate(WorkloadSpec("mixed", 2000)))["kinds"]
    assert kinds["long"] / 2000 == pytest.approx(0.1, abs=0.02)


def test_exact_rate_schedule():
    """With exact_rate the schedule's own rate is the offered rate, whatever the draw."""
    for seed in range(5):
        t = arrival_times(12, 2.5, burstiness=0.5, seed=seed)
        assert t[0] == 0 and np.all(np.diff(t) >= 0)
        assert achieved_rate(list(t)) == pytest.approx(2.5)


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_gamma_gaps_have_mean_one_over_rate_and_cv(burstiness):
    """Gaps average 1/rate with coefficient of variation 1/sqrt(burstiness) (1: Poisson)."""
    gaps = np.diff(arrival_times(100_000, 5.0, burstiness, seed=1, exact_rate=False))
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)


def test_infinite_rate_sends_all_at_once():
    """rate = inf: every request at t = 0."""
    assert np.array_equal(arrival_times(5, float("inf")), np.zeros(5))
