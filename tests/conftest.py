"""Shared fixtures: random-weight model folders, and engines whose block integrity is checked
after every test that builds one."""
from __future__ import annotations

import pytest

from engine import LLM
from tests.model_factory import make_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A random GQA Llama (4 heads, 2 KV heads) and its transformers twin."""
    path = tmp_path_factory.mktemp("llama_gqa")
    return str(path), make_model(path, "llama")


@pytest.fixture
def make_llm():
    """Builds offline LLMs; after the test, every block of every one of them is accounted for,
    and each is closed (a tensor-parallel one's worker processes stopped)."""
    built: list[LLM] = []

    def build(path: str, **kwargs) -> LLM:
        llm = LLM(path, **kwargs)
        built.append(llm)
        return llm

    yield build
    try:
        for llm in built:
            llm.engine.check_integrity()
            assert not llm.engine.scheduler.running, "a request was left running"
    finally:
        for llm in built:
            llm.close()
