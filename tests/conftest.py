"""Shared fixtures: random-weight model folders, and engines whose block integrity is checked
after every test that builds one."""
from __future__ import annotations

import threading

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


@pytest.fixture
def held(monkeypatch):
    """Compiles of a grammar whose spec starts with "held-" wait until the test sets this event: a
    compile as slow as the test wants, with no clock in the test (engines whose compiler is made
    after this fixture). Set at the end, so no compile outlives the test."""
    from engine.grammar import GrammarCompiler
    gate, real = threading.Event(), GrammarCompiler._compile

    def compile_(self, spec):
        if spec.spec.startswith("held-"):
            gate.wait(60)
        return real(self, spec)
    monkeypatch.setattr(GrammarCompiler, "_compile", compile_)
    yield gate
    gate.set()
