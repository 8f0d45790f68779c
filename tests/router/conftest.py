"""Fixtures shared by the router tests."""
from __future__ import annotations

import pytest

from tests.tiny_chat_model import tiny_chat_model_folder


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory):
    """A real engine on a tiny chat model (float32, CPU), one per test module."""
    from engine import CacheConfig, EngineConfig, LLMEngine

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_chat_model_folder(path)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                  cache=CacheConfig(block_size=16, num_blocks=64)))
