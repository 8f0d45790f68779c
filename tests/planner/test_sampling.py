"""bench/simulate/sampling.py: a measured figure's bootstrap interval over its point's requests, and
validate.py's list of the misses held against it."""
from __future__ import annotations

import numpy as np

from bench.simulate.sampling import inside, interval, values
from bench.simulate.validate import FIGURES, _sampling


def _request(ttft_ms: float, e2el_ms: float, tokens: int, success: bool = True) -> dict:
    return {"prompt_len": 8, "output_len": tokens, "ttft_ms": ttft_ms, "e2el_ms": e2el_ms, "output_tokens": tokens,
            "success": success}


def test_values_are_the_successful_requests_figures_as_the_metrics_take_them():
    """TTFT: every successful request's; TPOT: (E2EL - TTFT) / (tokens - 1), none for one token;
    a failed request gives neither."""
    reqs = [_request(100, 1100, 11), _request(50, 50, 1), _request(70, 470, 5, success=False)]
    assert values(reqs, "ttft").tolist() == [100, 50]
    assert values(reqs, "tpot").tolist() == [100.0]


def test_a_sample_of_one_value_has_no_spread_and_none_has_no_interval():
    assert interval(np.full(24, 80.0), "p90") == (80.0, 80.0)
    assert all(np.isnan(interval(np.array([]), "p50")))


def test_the_interval_holds_the_samples_own_figure_and_narrows_with_more_requests():
    """24 and 2,400 draws of one lognormal: each interval holds its sample's p90, and the larger
    sample's is at most a third as wide; the same seed gives the same interval."""
    rng = np.random.default_rng(7)
    small, large = rng.lognormal(5.0, 0.8, 24), rng.lognormal(5.0, 0.8, 2400)
    lo, hi = interval(small, "p90")
    assert inside(float(np.percentile(small, 90)), (lo, hi)) and hi > lo
    lo_l, hi_l = interval(large, "p90")
    assert inside(float(np.percentile(large, 90)), (lo_l, hi_l))
    assert hi_l - lo_l < (hi - lo) / 3
    assert interval(small, "p90") == (lo, hi)


def test_one_slow_request_of_24_stretches_the_p90_interval_upward_only():
    """23 requests at 100 ms and one at 2,000: the p90 is 100, and the resamples that draw the slow one
    three times or more lift the interval's top above it, never its bottom below 100."""
    ms = np.array([100.0] * 23 + [2000.0])
    lo, hi = interval(ms, "p90")
    assert lo == 100.0 and hi > 100.0


def _row(measured: float, simulated: float, span: tuple[float, float], node_priced: float | None = None) -> dict:
    row = {"workload": "mixed", "system": "colocated", "rate": 0.25}
    for label, _, _ in FIGURES:
        row[label] = {"measured": 100.0, "simulated": 100.0, "error": 0.0, "interval": (90.0, 110.0)}
    row["TTFT p90"] = {"measured": measured, "simulated": simulated, "error": simulated / measured - 1, "interval": span}
    if node_priced is not None:
        for label, _, _ in FIGURES:
            row[label]["node_priced"] = row[label]["simulated"]
        row["TTFT p90"]["node_priced"] = node_priced
    return row


def test_the_misses_are_listed_against_their_intervals_node_priced_first():
    """A figure 30% off inside its interval counts as held, one outside does not; figures within
    20% are not listed; where the row is node-priced, that figure decides."""
    text = _sampling([_row(1000, 700, (600, 1500)), _row(1000, 500, (800, 1200))])
    assert "1 of 2 simulated inside it" in text
    assert "measured 1000 [600..1500], simulated 700 inside" in text and "simulated 500 outside" in text
    assert "TTFT p50" not in text
    assert "0 of 0" in _sampling([_row(1000, 500, (800, 1200), node_priced=950)])
    empty = _sampling([_row(1000, 500, (float("nan"), float("nan")))])
    assert "0 of 1" in empty and "measured 1000 [no sample], simulated 500 outside" in empty
    bare = _row(1000, 500, (800, 1200))
    for label, _, _ in FIGURES:
        del bare[label]["interval"]
    assert _sampling([bare]) == ""          # a file without its requests: nothing resampled
