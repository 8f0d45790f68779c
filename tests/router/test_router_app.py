"""HTTP layer of the router against a deterministic fake backend: bodies, SSE, echo, auth,
metrics, aborts (errors: test_router_errors.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pdwire.sampling_params import SamplingParams
from router.http.app import create_app
from router.config import RouterConfig
from tests.fake_backend import MODEL, CharTokenizer, FakeBackend
from tests.http_helpers import UNCACHED, backend, client, error_of, events, strip_ids  # noqa: F401 -- fixtures


# ---------------------------------------------------------------- completions

def test_completion_body_and_usage(client, backend):
    """A non-streaming completion returns the full text, finish reason and exact usage."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, **UNCACHED}
    (_, prompt, params), = backend.requests
    assert prompt == [97, 98, 99] and params.max_tokens == 5


def test_completion_sampling_params_mapping(client, backend):
    """Request fields reach SamplingParams, extensions included, and max_completion_tokens wins."""
    client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 3, "max_completion_tokens": 4, "temperature": 0.5, "top_p": 0.9,
        "top_k": 7, "min_p": 0.1, "n": 2, "stop": "zz", "seed": 11, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "ignore_eos": True, "user": "u",
        "logprobs": 2})
    (_, _, p), = backend.requests
    assert p == SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, presence_penalty=0.5,
                               frequency_penalty=-0.5, repetition_penalty=1.2, seed=11, max_tokens=4,
                               stop=("zz",), ignore_eos=True, logprobs=2)


def test_completion_default_max_tokens_clamped_to_context(backend):
    """Without max_tokens the default (16) applies, clamped to the room left in the context."""
    client = TestClient(create_app(backend, RouterConfig(default_max_tokens=16)))
    client.post("/v1/completions", json={"prompt": "a" * 10})
    client.post("/v1/completions", json={"prompt": "a" * 60})
    assert [p.max_tokens for _, _, p in backend.requests] == [16, 4]


def test_completion_batch_and_n_indices(client):
    """A batch of prompts with n=2 yields choices indexed prompt * n + i, usage summed."""
    r = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 2})
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "he"), (1, "HE"), (2, "he"), (3, "HE")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13, **UNCACHED}


def test_completion_token_id_prompts(client, backend):
    """Token-id prompts, single or batched, reach the backend unchanged."""
    client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
    client.post("/v1/completions", json={"prompt": [[4], [5, 6]], "max_tokens": 1})
    assert [prompt for _, prompt, _ in backend.requests] == [[1, 2, 3], [4], [5, 6]]


def test_completion_stream_exact_sse(client):
    """A streamed completion is one text_completion chunk per token, then [DONE]."""
    with client.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    chunk = lambda text, reason: {"object": "text_completion", "model": MODEL, "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
    assert strip_ids(events(body)) == [chunk("h", None), chunk("e", None), chunk("l", "length"), "[DONE]"]


def test_stream_holds_back_what_could_start_a_stop_string(client):
    """With stop strings, the last (longest stop - 1) characters wait until the next text or the end."""
    with client.stream("POST", "/v1/completions", json={
            "prompt": "abc", "max_tokens": 5, "stream": True, "stop": ["zz", "qqqq"]}) as r:
        chunks = events(r.read().decode())
    texts = [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert texts == [("h", None), ("ello", "length")]        # "hello": 3 characters held while running


def test_completion_stream_include_usage(client):
    """With include_usage every chunk has usage null and a last chunk carries the totals."""
    with client.stream("POST", "/v1/completions", json={
            "prompt": "abc", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = events(r.read().decode())
    assert [c["usage"] for c in chunks[:2]] == [None, None]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, **UNCACHED}
    assert chunks[3] == "[DONE]"


def test_completion_logprobs(client):
    """Completion logprobs list tokens, their logprobs, ranked top entries and text offsets."""
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logprobs": 1})
    assert r.json()["choices"][0]["logprobs"] == {
        "tokens": ["h", "e"], "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"h": -0.5, "i": -1.5}, {"e": -0.5, "f": -1.5}], "text_offset": [0, 1]}


def test_completion_echo_puts_the_prompt_first(client, backend):
    """echo: each choice's text starts with its prompt (a string as given, token ids decoded);
    streamed, the prompt is a chunk of its own; the engine is asked for no prompt logprobs."""
    body = client.post("/v1/completions", json={"prompt": ["ab", "xy"], "max_tokens": 3, "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == ["abhel", "xyhel"]
    body = client.post("/v1/completions", json={"prompt": [99, 100], "max_tokens": 3, "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == ["cdhel"]
    assert all(params.prompt_logprobs is None for _, _, params in backend.requests)
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True, "stream": True})
    chunks = events(r.text)
    assert [c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]] == ["ab", "h", "e"]


def test_completion_echo_with_logprobs_scores_the_prompt_tokens(client, backend):
    """echo + logprobs (what lm-eval-harness asks for): the prompt's tokens come first, the first
    without a logprob, with text offsets running on into the completion's."""
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True,
                                                 "logprobs": 1}).json()
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "abche"
    assert lp["tokens"] == ["a", "b", "c", "h", "e"] and lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["token_logprobs"] == [None, -0.25, -0.25, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -0.25, "c": -2.0}
    assert backend.requests[-1][2].prompt_logprobs == 1


def test_completion_echo_with_max_tokens_0_scores_the_prompt_only(client, backend):
    """echo, logprobs and max_tokens 0 (scoring a prompt): the prompt and its tokens' logprobs,
    no completion tokens (one runs and is dropped), finish "length", streamed or not."""
    payload = {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0}
    body = client.post("/v1/completions", json=payload).json()
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("abc", "length")
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"] and choice["logprobs"]["token_logprobs"][0] is None
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3, **UNCACHED}
    assert backend.requests[-1][2].max_tokens == 1
    chunks = events(client.post("/v1/completions", json={**payload, "stream": True}).text)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]] == \
        [("abc", None), ("", "length")]
    error_of(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0}), 400)


# ---------------------------------------------------------------- chat

def test_chat_body_uses_chat_template(client, backend):
    """Chat messages are rendered by the chat template and answered as an assistant message."""
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 5,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                "logprobs": None, "finish_reason": "length"}]
    (_, prompt, params), = backend.requests
    assert CharTokenizer().decode(prompt) == "[system]s[user]hi[assistant]"
    assert params.max_tokens == 5
    prompt_len = len("[system]s[user]hi[assistant]")
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5, "total_tokens": prompt_len + 5,
                             **UNCACHED}


def test_chat_default_max_tokens_is_context(client, backend):
    """Chat without max_tokens runs to the end of the context (max_tokens None)."""
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert backend.requests[0][2].max_tokens is None


def test_chat_stream_exact_sse(client):
    """A chat stream opens with the assistant role, sends content deltas, finishes, then [DONE]."""
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = strip_ids(events(r.read().decode()))
    head = {"object": "chat.completion.chunk", "model": MODEL}
    choice = lambda delta, reason: {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    assert chunks == [
        {**head, "choices": [choice({"role": "assistant", "content": ""}, None)], "usage": None},
        {**head, "choices": [choice({"content": "h"}, None)], "usage": None},
        {**head, "choices": [choice({"content": "e"}, "length")], "usage": None},
        {**head, "choices": [], "usage": {"prompt_tokens": 19, "completion_tokens": 2, "total_tokens": 21,
                                          **UNCACHED}},
        "[DONE]"]


def test_chat_logprobs(client, backend):
    """Chat logprobs give the sampled token and top_logprobs entries with bytes."""
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 2})
    assert backend.requests[0][2].logprobs == 2
    assert r.json()["choices"][0]["logprobs"] == {"content": [{
        "token": "h", "logprob": -0.5, "bytes": [104],
        "top_logprobs": [{"token": "h", "logprob": -0.5, "bytes": [104]},
                         {"token": "i", "logprob": -1.5, "bytes": [105]}]}]}


# ---------------------------------------------------------------- auth, models, health, metrics

def test_api_key(backend):
    """With an api_key, /v1 needs the right Bearer token (401 otherwise); /health does not."""
    client = TestClient(create_app(backend, RouterConfig(api_key="sekrit-sekrit-sekrit")))
    assert error_of(client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    error_of(client.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer nope"}), 401)
    ok = client.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer sekrit-sekrit-sekrit"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200


def test_models_and_served_name(backend):
    """/v1/models lists the served name (the override when given) and the context length."""
    client = TestClient(create_app(backend, RouterConfig(served_model_name="alias")))
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data["data"]] == [("alias", "model", 64)]
    assert client.post("/v1/completions", json={"model": "alias", "prompt": "a"}).status_code == 200
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 404


def test_metrics_exposition(client):
    """/metrics shows request histograms, outcome counters and per-node gauges from the backend."""
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "reject"})
    text = client.get("/metrics").text
    for line in ['pdserve_time_to_first_token_seconds_count{model_name="fake-model"} 1.0',
                 'pdserve_inter_token_latency_seconds_count{model_name="fake-model"} 2.0',
                 'pdserve_e2e_request_latency_seconds_count{model_name="fake-model"} 1.0',
                 'pdserve_request_success_total{finish_reason="length",model_name="fake-model"} 1.0',
                 'pdserve_request_failure_total{model_name="fake-model",reason="rejected"} 1.0',
                 'pdserve_prompt_tokens_total{model_name="fake-model"} 3.0',
                 'pdserve_generation_tokens_total{model_name="fake-model"} 3.0',
                 'pdserve_num_requests_running{node="colocated",role="colocated"} 2.0',
                 'pdserve_num_requests_waiting{node="colocated",role="colocated"} 1.0',
                 'pdserve_kv_cache_usage{node="colocated",role="colocated"} 0.25',
                 'pdserve_prefix_cache_hit_rate{node="colocated",role="colocated"} 0.5',
                 'pdserve_num_preemptions_total{node="colocated",role="colocated"} 3.0']:
        assert line in text, line


def test_metrics_registry_per_app(backend):
    """Two apps keep separate metric registries (no global state)."""
    a, b = TestClient(create_app(backend)), TestClient(create_app(backend))
    a.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
    assert 'pdserve_e2e_request_latency_seconds_count{model_name="fake-model"} 1.0' in a.get("/metrics").text
    assert 'pdserve_e2e_request_latency_seconds_count{model_name="fake-model"} 0.0' in b.get("/metrics").text


# ---------------------------------------------------------------- client disconnect

async def _call_then_disconnect(app, backend: FakeBackend, payload: dict) -> list[dict]:
    """Drives the ASGI app by hand: sends the body, waits until the request hangs, disconnects."""
    gone = asyncio.Event()
    messages = [{"type": "http.request", "body": json.dumps(payload).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(backend.hanging.wait(), 5)
    gone.set()
    await asyncio.wait_for(task, 5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts(stream):
    """A client that disconnects mid-request (streaming or not) gets its backend request aborted."""
    backend = FakeBackend()
    app = create_app(backend)
    sent = asyncio.run(_call_then_disconnect(app, backend, {"prompt": "hang", "stream": stream}))
    assert len(backend.aborted) == 1 and backend.aborted[0].startswith("cmpl-")
    if stream:
        bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert bodies.startswith(b'data: {"id"') and b"[DONE]" not in bodies


def test_continuous_usage_stats_on_every_chunk(client):
    """stream_options.continuous_usage_stats: every chunk carries the usage so far, then the final one."""
    for path, body in (("/v1/completions", {"prompt": "abc"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]})):
        r = client.post(path, json={**body, "max_tokens": 3, "stream": True,
                                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        chunks = events(r.text)[:-1]
        prompt = chunks[0]["usage"]["prompt_tokens"]
        completion = [c["usage"]["completion_tokens"] for c in chunks]
        assert completion == ([0] if "chat" in path else []) + [1, 2, 3, 3]
        assert all(c["usage"] == {"prompt_tokens": prompt, "completion_tokens": k, "total_tokens": prompt + k,
                                  **UNCACHED} for c, k in zip(chunks, completion))
        assert chunks[-1]["choices"] == []


def test_usage_without_continuous_stats_is_null_per_chunk(client):
    """include_usage alone: chunks carry usage null, only the last one has it."""
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = events(r.text)[:-1]
    assert [c["usage"] is None for c in chunks] == [True, True, False]
