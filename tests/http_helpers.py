"""Fixtures and checks shared by the router's HTTP tests: a fake backend, a client on it, SSE
framing and OpenAI's error shape."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from router.http.app import create_app
from router.config import RouterConfig
from tests.fake_backend import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend) -> TestClient:
    return TestClient(create_app(backend, RouterConfig()))


def events(body: str) -> list:
    """SSE body -> list of JSON payloads (and "[DONE]"); checks the framing exactly."""
    assert body.endswith("\n\n")
    parts = body[:-2].split("\n\n")
    assert all(p.startswith("data: ") for p in parts)
    return [p[6:] if p[6:] == "[DONE]" else json.loads(p[6:]) for p in parts]


def strip_ids(chunks: list) -> list:
    """Checks every chunk shares one id and created time, then drops them for exact comparison."""
    payloads = [c for c in chunks if c != "[DONE]"]
    assert len({c["id"] for c in payloads}) == 1 and len({c["created"] for c in payloads}) == 1
    return [c if c == "[DONE]" else {k: v for k, v in c.items() if k not in ("id", "created")}
            for c in chunks]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


UNCACHED = {"prompt_tokens_details": {"cached_tokens": 0}}     # usage of a prompt without prefix-cache hits
