"""GET /v1/models/{id}, POST /tokenize and /detokenize, GET /version against the fake backend."""
from __future__ import annotations

import importlib.metadata

from fastapi.testclient import TestClient

from router.http.app import create_app
from router.config import RouterConfig
from tests.fake_backend import MODEL, FakeBackend
from tests.http_helpers import backend, client, error_of  # noqa: F401 -- fixtures


def test_model_card_by_id(client):
    """/v1/models/{id} answers the served model's card, as one entry of /v1/models."""
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200
    assert r.json() == client.get("/v1/models").json()["data"][0]
    assert r.json()["id"] == MODEL and r.json()["object"] == "model"


def test_unknown_model_id_is_a_short_404(client):
    """An unknown id: 404 model_not_found in OpenAI's shape, quoting only a prefix of the id."""
    error = error_of(client.get("/v1/models/" + "x" * 5000), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"] == f"The model `{'x' * 64}... (5000 characters)` does not exist."


def test_tokenize_prompt(client):
    """A prompt's token ids, their count and the context length (vLLM's shape)."""
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "abc"})
    assert r.status_code == 200
    assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [97, 98, 99]}


def test_tokenize_messages_as_chat_renders_them(client):
    """Messages tokenize as chat completions renders them, the assistant's turn opened."""
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == [ord(c) for c in "[user]hi[assistant]"]


def test_tokenize_needs_exactly_one_input(client):
    """Neither or both of prompt and messages: a 400."""
    error_of(client.post("/tokenize", json={}), 400)
    error_of(client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400)


def test_tokenize_applies_prompt_limits(backend):
    """/tokenize refuses a prompt over --max-prompt-chars, as completions does."""
    client = TestClient(create_app(backend, RouterConfig(max_prompt_chars=4)))
    error = error_of(client.post("/tokenize", json={"prompt": "abcde"}), 400)
    assert error["message"] == "prompt length (characters): 5 is over the limit of 4 (--max-prompt-chars)"


def test_tokenize_unknown_model_is_404(client):
    """A named model other than the served one: 404 model_not_found."""
    assert error_of(client.post("/tokenize", json={"model": "other", "prompt": "a"}), 404)["code"] == "model_not_found"


def test_detokenize(client):
    """Token ids back to text; an id outside the vocabulary is a 400 naming `tokens`."""
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert error_of(client.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"


def test_detokenize_applies_token_limit(backend):
    """/detokenize refuses more ids than --max-prompt-token-ids."""
    client = TestClient(create_app(backend, RouterConfig(max_prompt_token_ids=2)))
    assert error_of(client.post("/detokenize", json={"tokens": [1, 2, 3]}), 400)["param"] == "tokens"


def test_the_openapi_schema_needs_the_api_key_and_docs_pages_are_off():
    """With an API key, /openapi.json needs it (it was open, the /admin routes listed); /docs and
    /redoc are not served; with no key the schema is open."""
    client = TestClient(create_app(FakeBackend(), RouterConfig(api_key="k" * 16)))
    assert error_of(client.get("/openapi.json"), 401)["code"] == "invalid_api_key"
    schema = client.get("/openapi.json", headers={"Authorization": "Bearer " + "k" * 16}).json()
    assert "/v1/completions" in schema["paths"]
    assert client.get("/docs").status_code == client.get("/redoc").status_code == 404
    assert TestClient(create_app(FakeBackend(), RouterConfig())).get("/openapi.json").status_code == 200


def test_tokenize_endpoints_need_the_api_key():
    """/tokenize, /detokenize and /v1/models/{id} need the key; /version does not."""
    client = TestClient(create_app(FakeBackend(), RouterConfig(api_key="k" * 16)))
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
    assert client.post("/detokenize", json={"tokens": [97]}).status_code == 401
    assert client.get(f"/v1/models/{MODEL}").status_code == 401
    ok = client.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer " + "k" * 16})
    assert ok.json()["tokens"] == [97]
    assert client.get("/version").json() == {"version": importlib.metadata.version("pdserve")}
