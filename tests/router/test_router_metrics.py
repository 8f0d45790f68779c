"""The request histograms, node counters and exposition of router/http/metrics.py, with a fake clock."""
from __future__ import annotations

from pdwire.control import TokenDelta, FirstToken
from pdwire.figures import PrefixCounters
from pdwire.outputs import CompletionOutput, RequestOutput
from router.backend import NodeMetrics
from router.cluster.disagg_request import Attempt, TransferTimer
from router.http.metrics import RouterMetrics, token_buckets
from pdwire.sampling_params import SamplingParams
from tests.fake_backend import FakeBackend

M = 'model_name="fake-model"'


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NodesBackend(FakeBackend):
    def metrics(self):
        return [NodeMetrics("p0", "prefill", 0, 0, 0.5, 0.25, 1, (), PrefixCounters(96, 32), 16, 512)]


def _out(tokens: int, finished: bool = False, queue: float | None = 0.5) -> RequestOutput:
    """A delta of `tokens` new tokens."""
    choice = CompletionOutput(0, "x" * tokens, list(range(tokens)), None, "length" if finished else None)
    return RequestOutput("r", [1, 2, 3, 4, 5], [choice], finished, queue_time=queue)


def _text(metrics: RouterMetrics) -> str:
    return metrics.render().decode()


def test_request_phases_split_ttft_and_the_rest():
    """queue = the backend's queue_time, prefill = TTFT - queue, decode = last - first token; lengths per request."""
    clock = Clock()
    metrics = RouterMetrics(FakeBackend(), clock)
    tracker = metrics.tracker()
    clock.now = 102.0
    tracker.on_output(_out(1))
    clock.now = 105.0
    tracker.on_output(_out(3, finished=True))
    text = _text(metrics)
    for line in (f"pdserve_time_to_first_token_seconds_sum{{{M}}} 2.0",
                 f"pdserve_request_queue_time_seconds_sum{{{M}}} 0.5",
                 f"pdserve_request_prefill_time_seconds_sum{{{M}}} 1.5",
                 f"pdserve_request_decode_time_seconds_sum{{{M}}} 3.0",
                 f"pdserve_e2e_request_latency_seconds_sum{{{M}}} 5.0",
                 f"pdserve_request_prompt_tokens_sum{{{M}}} 5.0",
                 f'pdserve_request_prompt_tokens_bucket{{le="5.0",{M}}} 1.0',
                 f'pdserve_request_prompt_tokens_bucket{{le="2.0",{M}}} 0.0',
                 f"pdserve_request_generation_tokens_sum{{{M}}} 4.0"):
        assert line in text, line


def test_no_queue_time_means_no_queue_or_prefill_sample():
    """A backend that reports no queue time leaves the queue and prefill histograms empty."""
    metrics = RouterMetrics(FakeBackend(), Clock())
    metrics.tracker().on_output(_out(1, finished=True, queue=None))
    text = _text(metrics)
    assert f"pdserve_request_queue_time_seconds_count{{{M}}} 0.0" in text
    assert f"pdserve_request_prefill_time_seconds_count{{{M}}} 0.0" in text
    assert f"pdserve_time_to_first_token_seconds_count{{{M}}} 1.0" in text


def test_node_prefix_counters_and_cache_config():
    """Each node's prefix-cache query and hit tokens are counters; its block layout is an info series."""
    text = _text(RouterMetrics(NodesBackend()))
    for line in ('pdserve_prefix_cache_queries_total{node="p0",role="prefill"} 96.0',
                 'pdserve_prefix_cache_hits_total{node="p0",role="prefill"} 32.0',
                 'pdserve_cache_config_info{block_size="16",node="p0",num_blocks="512",role="prefill"} 1.0'):
        assert line in text, line


def test_exposition_has_process_metrics_and_no_created_series():
    """The registry carries process_* series and renders no *_created sample."""
    text = _text(RouterMetrics(FakeBackend()))
    assert "process_cpu_seconds_total " in text and "process_resident_memory_bytes " in text
    assert "_created" not in text


def test_token_buckets_are_1_2_5_up_to_the_context():
    """Length buckets run 1, 2, 5, 10, ... and stop at the largest not above the context."""
    assert token_buckets(64) == (1, 2, 5, 10, 20, 50)
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


class Recorder:
    def __init__(self):
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)


def test_transfer_timer_measures_first_token_to_decode_delta_once():
    """The KV transfer time is P's FirstToken to D's first TokenDelta, observed once per attempt."""
    clock, recorder = Clock(), Recorder()
    att = Attempt("r", [1, 2], SamplingParams(), 0, 0)
    att.decode_id = "d0"
    timer = TransferTimer(recorder, clock)
    att.first_token = True
    timer.note(("p0", FirstToken("r", 7, "a", None, "")), att)
    for t in (100.25, 100.5):
        clock.now = t
        timer.note(("d0", TokenDelta("r", 0, (7, 8), 0, "ab", None, "")), att)
    assert recorder.values == [0.25]
