"""HTTP errors of the router against a deterministic fake backend: every bad request is a 400 in
OpenAI's error shape naming its parameter, unforeseen failures are 500s in that shape, and the
app serves on."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.http.app import create_app
from router.config import RouterConfig
from tests.http_helpers import backend, client, error_of, events  # noqa: F401 -- fixtures


@pytest.mark.parametrize("payload, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 2}, "top_p"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1000}, "max_tokens"),
    ({"prompt": "a" * 64}, "prompt"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "n": "many"}, "n"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "logprobs": 50}, "logprobs"),
    ({"prompt": "a", "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ({"prompt": "please reject"}, "prompt"),
    ({"prompt": "a", "n": 129}, "n"),
    ({"prompt": "a", "seed": 2 ** 64}, "seed"),
    ({"prompt": "a", "top_k": 2 ** 63}, "top_k"),
    ({"prompt": "a", "min_tokens": 2 ** 64}, "min_tokens"),
    ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "a", "stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_bad_input_is_400(client, backend, payload, param):
    """Bad completion input answers 400 in OpenAI's error shape, naming the bad parameter."""
    error = error_of(client.post("/v1/completions", json=payload), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None
    assert error["message"]


@pytest.mark.parametrize("payload, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "n": 2, "logprobs": True},
     "logprobs"),
])
def test_chat_bad_input_is_400(client, payload, param):
    """Bad chat input answers 400 in OpenAI's error shape."""
    error = error_of(client.post("/v1/chat/completions", json=payload), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_malformed_json_is_400(client):
    """A body that is not JSON answers 400, not FastAPI's 422, and names no parameter."""
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    error = error_of(r, 400)
    assert error["param"] is None and "could not parse the JSON body" in error["message"]


def test_unknown_path_and_method_answer_in_openai_shape(client):
    """404 for an unknown path and 405 for a wrong method carry the {error} body too."""
    assert error_of(client.post("/v1/embeddings", json={}), 404)["type"] == "not_found_error"
    assert error_of(client.get("/v1/completions"), 405)["type"] == "invalid_request_error"


def test_unforeseen_backend_error_is_500_in_openai_shape(backend):
    """An exception no handler expects (here an OverflowError) answers 500 with the {error} body."""
    async def explode(*args, **kwargs):
        raise OverflowError("int too big to convert")
        yield
    backend.generate = explode
    client = TestClient(create_app(backend, RouterConfig()), raise_server_exceptions=False)
    error = error_of(client.post("/v1/completions", json={"prompt": "abc"}), 500)
    assert error["type"] == "internal_error" and "OverflowError" in error["message"]


def test_unknown_model_is_404(client):
    """An unknown model name answers 404 model_not_found on both endpoints."""
    for path, extra in [("/v1/completions", {"prompt": "a"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})]:
        error = error_of(client.post(path, json={"model": "gpt-5", **extra}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


def test_serves_after_bad_requests(client):
    """The app keeps answering normally after a run of bad requests."""
    for payload in [{"prompt": ""}, {"prompt": "a", "n": 0}, {"prompt": "reject"}, {"model": "x", "prompt": "a"}]:
        assert client.post("/v1/completions", json=payload).status_code in (400, 404)
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "he"


def test_engine_rejection_in_stream_is_400(client, backend):
    """A backend rejection of a streamed request still answers 400 before any SSE byte."""
    error = error_of(client.post("/v1/completions", json={"prompt": "reject", "stream": True}), 400)
    assert error["message"] == "prompt rejected by the engine"


def test_batch_rejection_aborts_the_other_prompts(client, backend):
    """When one prompt of a batch is rejected, the others are aborted and the answer is 400."""
    error_of(client.post("/v1/completions", json={"prompt": ["hang", "reject"], "max_tokens": 5}), 400)
    assert [rid.rsplit("-", 1)[1] for rid in backend.aborted] == ["0"]


def test_failure_midstream_sends_error_event(client, backend):
    """A backend failure after the stream started ends it with an error event and [DONE]."""
    with client.stream("POST", "/v1/completions", json={"prompt": "fail", "stream": True}) as r:
        chunks = events(r.read().decode())
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["h", "e"]
    assert chunks[2]["error"]["message"] == "engine exploded" and chunks[3] == "[DONE]"


def test_failure_non_streaming_is_500(client):
    """A backend failure in a non-streaming request answers 500 in OpenAI's shape."""
    assert error_of(client.post("/v1/completions", json={"prompt": "fail"}), 500)["type"] == "internal_error"
