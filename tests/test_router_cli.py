"""The launcher's flags, generated from the config dataclasses."""
from __future__ import annotations

import argparse

import pytest

from engine import EngineConfig
from router.cli import add_dataclass_args, build_dataclass
from router.config import RouterConfig


def _parse(argv: list[str]) -> tuple[RouterConfig, EngineConfig]:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, RouterConfig)
    add_dataclass_args(parser, EngineConfig)
    args = vars(parser.parse_args(argv))
    return build_dataclass(RouterConfig, args), build_dataclass(EngineConfig, args)


def test_no_flags_give_the_defaults():
    """Without flags both configs equal their dataclass defaults."""
    assert _parse([]) == (RouterConfig(), EngineConfig())


def test_flags_reach_fields_and_nested_configs():
    """Scalar, optional, boolean and nested (prefixed) fields are set from flags."""
    router, engine = _parse(["--port", "9000", "--api-key", "k", "--model", "/m", "--max-model-len", "128",
                             "--cache-num-blocks", "32", "--no-cache-enable-prefix-caching",
                             "--scheduler-max-num-seqs", "4"])
    assert (router.port, router.api_key, router.host) == (9000, "k", "127.0.0.1")
    assert (engine.model, engine.max_model_len) == ("/m", 128)
    assert (engine.cache.num_blocks, engine.cache.enable_prefix_caching) == (32, False)
    assert engine.scheduler.max_num_seqs == 4


def test_invalid_values_are_refused():
    """Config validation runs on flag values."""
    with pytest.raises(ValueError, match="port"):
        _parse(["--port", "70000"])
