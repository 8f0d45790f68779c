"""Size limits and strict types at the HTTP edge (issue #14): each refused with a 400 in OpenAI's
shape that names the limit, before the backend sees the request."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from router.http.app import create_app
from router.config import RouterConfig
from tests.fake_backend import MODEL, FakeBackend
from tests.http_helpers import error_of


def _client(backend: FakeBackend, **limits) -> TestClient:
    return TestClient(create_app(backend, RouterConfig(**limits)))


def _post(client: TestClient, path: str, body: dict | str):
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


def test_a_17_mib_stop_list_is_refused_by_the_body_limit():
    """The finding: 17k stop strings of 1 KB never reach the backend; the body limit answers first."""
    backend = FakeBackend()
    body = {"prompt": "hi", "stop": ["x" * 1024] * 17_000}
    err = error_of(_post(_client(backend), "/v1/completions", body), 400)
    assert "--max-body-bytes" in err["message"] and backend.requests == []


def test_a_chunked_body_over_the_limit_is_refused():
    """A chunked body (no Content-Length) is cut off as soon as it passes max_body_bytes."""
    backend = FakeBackend()
    chunks = (b'{"prompt": "' + b"a" * 1000 for _ in range(3))
    response = _client(backend, max_body_bytes=2000).post("/v1/completions", content=chunks,
                                                          headers={"Content-Type": "application/json"})
    assert "--max-body-bytes" in error_of(response, 400)["message"] and backend.requests == []


@pytest.mark.parametrize("body, flag, param", [
    ({"prompt": "hi", "stop": ["a"] * 17}, "max-stop-strings", "stop"),
    ({"prompt": "hi", "stop": "a" * 257}, "max-stop-chars", "stop"),
    ({"prompt": "a" * 101}, "max-prompt-chars", "prompt"),
    ({"prompt": ["a" * 60, "b" * 60]}, "max-prompt-chars", "prompt"),
    ({"prompt": [[1] * 60, [2] * 60]}, "max-prompt-token-ids", "prompt"),
    ({"prompt": "hi", "n": 129}, "max-n", "n"),
    ({"prompt": "hi", "logprobs": 21}, "max-logprobs", "logprobs"),
    ({"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(301)}}, "max-logit-bias", "logit_bias"),
    ({"messages": [{"role": "user", "content": "a" * 101}]}, "max-prompt-chars", "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 3}, "max-logprobs",
     "top_logprobs"),
])
def test_each_size_limit_is_a_400_naming_its_flag(body, flag, param):
    """Over any limit: a 400 whose message names the flag and whose param names the field."""
    backend = FakeBackend()
    client = _client(backend, max_prompt_chars=100, max_prompt_token_ids=100,
                     max_logprobs=2 if "messages" in body else 20)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = error_of(_post(client, path, body), 400)
    assert f"--{flag}" in err["message"] and err["param"] == param
    assert backend.requests == []


def test_echo_logprobs_work_over_the_limit_is_refused():
    """The 12 KB request that built a 311 MB response: refused, naming max_logprob_cells."""
    backend = FakeBackend(max_model_len=2048)
    body = {"prompt": [[5] * 1023] * 4, "max_tokens": 1, "n": 128, "logprobs": 20, "echo": True}
    err = error_of(_post(_client(backend), "/v1/completions", body), 400)
    assert "--max-logprob-cells" in err["message"] and "11010048" in err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("body, param", [
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": "hi", "n": "2"}, "n"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ({"prompt": "hi", "echo": 1}, "echo"),
])
def test_types_are_strict(body, param):
    """Bools are not ints and strings are not numbers or bools."""
    backend = FakeBackend()
    err = error_of(_post(_client(backend), "/v1/completions", body), 400)
    assert err["param"].split(".")[0] == param and backend.requests == []


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "a\\ud800b"}'),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
])
def test_a_lone_surrogate_is_a_400(path, body):
    """Text that is not valid Unicode (a lone UTF-16 surrogate) is a 400, not a 500."""
    backend = FakeBackend()
    err = error_of(_post(_client(backend), path, body), 400)
    assert "not valid Unicode" in err["message"] and backend.requests == []


METRICS, ADMIN, API = "metrics-key-0123456789", "admin-key-0123456789", "api-key-0123456789"


@pytest.mark.parametrize("keys, accepted", [
    ({"metrics_api_key": METRICS, "admin_api_key": ADMIN, "api_key": API}, {METRICS, ADMIN}),
    ({"admin_api_key": ADMIN, "api_key": API}, {ADMIN}),
    ({"api_key": API}, {API}),
    ({}, {None, "wrong", METRICS, ADMIN, API})])
def test_metrics_need_the_metrics_or_admin_key_whenever_a_key_is_set(keys, accepted):
    """/metrics takes the metrics key or the admin key; with neither set, the API key; it is open
    only on a router with no key at all (it was open whenever no metrics key was set)."""
    client = _client(FakeBackend(), **keys)
    for key in (None, "wrong", METRICS, ADMIN, API):
        reply = client.get("/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert reply.status_code == (200 if key in accepted else 401), key


@pytest.mark.parametrize("field", ["api_key", "admin_api_key", "metrics_api_key"])
def test_keys_shorter_than_the_minimum_are_refused(field):
    """A key of 15 characters is refused at startup with a message naming its flag, its variable and
    the minimum; 16 is accepted."""
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} or \\$PDSERVE_.* is 15 characters; a key "
                                         "must have at least 16"):
        RouterConfig(**{field: "k" * 15})
    assert getattr(RouterConfig(**{field: "k" * 16}), field) == "k" * 16


def test_a_long_model_name_is_quoted_short():
    """A 1 MB model name is not echoed back whole: the 404 quotes a short prefix."""
    err = error_of(_post(_client(FakeBackend()), "/v1/completions", {"model": "m" * (1 << 20), "prompt": "hi"}), 404)
    assert len(err["message"]) < 200 and "1048576 characters" in err["message"]


def test_limits_leave_ordinary_requests_alone():
    """A request inside every limit is served as before."""
    r = _post(_client(FakeBackend()), "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x"], "n": 2})
    assert r.status_code == 200 and [c["text"] for c in r.json()["choices"]] == ["hello world", "HELLO WORLD"]


def test_a_body_of_too_many_json_values_is_refused_before_parsing_but_commas_in_text_are_text():
    """Beyond --max-prompt-token-ids + 65,536 JSON values the body is refused unparsed; commas,
    quotes and backslashes inside strings are not counted."""
    backend = FakeBackend()
    client = _client(backend, max_prompt_token_ids=100)
    err = error_of(_post(client, "/v1/completions", {"prompt": [1] * 70_000}), 400)
    assert err["message"] == ("JSON values in the request body: 69999 is over the limit of 65636 "
                              "(--max-prompt-token-ids)") and backend.requests == []
    text = ',\\"\\\\' * 25_000       # 125,000 characters: parsed and tokenized, too long for the model
    err = error_of(_post(client, "/v1/completions", {"prompt": text, "max_tokens": 1}), 400)
    assert err["message"] == "This model's maximum context length is 64 tokens, but the prompt has 125000 tokens."
