"""Serving metrics on hand-made timelines: the values `vllm bench serve` would report."""
import math

import pytest

from bench.serving.metrics import SLO, RequestRecord, distserve_goodput, summarize


def _timeline():
    a = RequestRecord(10, 4, ttft=0.1, itl=[0.05, 0.1, 0.05], latency=0.3, output_tokens=4, success=True)
    b = RequestRecord(20, 2, ttft=0.2, itl=[0.3], latency=0.5, output_tokens=2, success=True)
    c = RequestRecord(30, 1, ttft=0.05, itl=[], latency=0.05, output_tokens=1, success=True)
    d = RequestRecord(40, 8, error="HTTP 500")
    return [a, b, c, d]


def test_tpot_excludes_first_token():
    """TPOT = (E2EL - TTFT) / (output tokens - 1), undefined for one token."""
    a, b, c, _ = _timeline()
    assert a.tpot == pytest.approx(0.2 / 3)
    assert b.tpot == pytest.approx(0.3)
    assert c.tpot is None


def test_summary_latencies_match_hand_computation():
    """Means and percentiles of TTFT/TPOT/ITL/E2EL in ms, over completed requests only."""
    m = summarize(_timeline(), duration_s=1.0, offered_rate=4.0, achieved_rate=4.0, slo=SLO())
    assert (m.num_sent, m.completed, m.failed) == (4, 3, 1)
    assert m.ttft.mean == pytest.approx(350 / 3) and m.ttft.p50 == pytest.approx(100)
    assert m.tpot.mean == pytest.approx((200 / 3 + 300) / 2) and m.tpot.p50 == pytest.approx(m.tpot.mean)
    assert m.itl.mean == pytest.approx(125) and m.itl.p50 == pytest.approx(75)    # [50, 50, 100, 300]
    assert m.itl.p99 == pytest.approx(100 + 0.97 * 200)                          # numpy linear
    assert m.e2el.mean == pytest.approx(850 / 3)


def test_throughputs_count_completed_requests_over_wall_time():
    """Request, output and total token throughput divide completed work by the duration."""
    m = summarize(_timeline(), duration_s=2.0, offered_rate=4.0, achieved_rate=3.5, slo=SLO())
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5) and m.total_output_tokens == 7
    assert m.total_token_throughput == pytest.approx((7 + 60) / 2)


def test_normalized_latency_is_mean_latency_per_output_token():
    """vLLM paper: mean over requests of E2EL / output tokens."""
    m = summarize(_timeline(), 1.0, 4.0, 4.0, SLO())
    assert m.normalized_latency_s == pytest.approx((0.3 / 4 + 0.5 / 2 + 0.05 / 1) / 3)


def test_goodput_and_slo_attainment():
    """vLLM goodput counts completed requests within every SLO per second; DistServe attainment
    divides requests meeting TTFT and TPOT by all requests, failures included."""
    m = summarize(_timeline(), 2.0, 4.0, 4.0, SLO(ttft_ms=150, tpot_ms=100))
    assert m.goodput == pytest.approx(2 / 2.0)          # a and c (c's TPOT counts as 0)
    assert m.slo_attainment == pytest.approx(2 / 4)
    inclusive = summarize(_timeline(), 1.0, 4.0, 4.0, SLO(ttft_ms=200))
    assert inclusive.goodput == pytest.approx(3)        # value <= SLO passes


def test_empty_lists_report_zero_like_vllm():
    """With no completed request every latency reads 0 and the attainment 0."""
    m = summarize([RequestRecord(5, 5, error="x")], 1.0, 1.0, 1.0, SLO(100, 100))
    assert m.ttft.mean == 0 and m.itl.p99 == 0 and m.slo_attainment == 0
    assert math.isnan(m.normalized_latency_s)


def test_distserve_goodput_is_highest_rate_before_first_miss():
    """DistServe goodput: the highest swept rate with attainment >= 90% and no miss below it."""
    assert distserve_goodput([(1, 0.95), (4, 0.5), (2, 0.9), (3, 0.92)]) == 3
    assert distserve_goodput([(1, 0.95), (2, 0.5), (3, 0.95)]) == 1
    assert distserve_goodput([(1, 0.8), (2, 0.95)]) == 0
