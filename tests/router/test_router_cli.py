"""Every CLI's flags come from the config dataclasses: one name per knob, a help line per flag."""
from __future__ import annotations

import argparse

import pytest

from engine.args import EngineArgs
from engine.flags import add_dataclass_args, build_dataclass, field_help
from node_shell.config import NodeConfig
from router.config import RouterConfig
from router.launcher import _parser
from router.node_processes import ClusterConfig


def _parse(argv: list[str]) -> tuple[RouterConfig, EngineArgs]:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, RouterConfig)
    add_dataclass_args(parser, EngineArgs)
    args = vars(parser.parse_args(argv))
    return build_dataclass(RouterConfig, args), build_dataclass(EngineArgs, args)


def test_no_flags_give_the_defaults():
    """Without flags both configs equal their dataclass defaults."""
    assert _parse([]) == (RouterConfig(), EngineArgs())


def test_flags_reach_fields_and_the_engine_config():
    """Scalar, optional and boolean fields are set from flags, and reach the engine's nested config."""
    router, args = _parse(["--port", "9000", "--api-key", "k" * 16, "--model", "/m", "--max-model-len", "128",
                           "--num-blocks", "32", "--no-enable-prefix-caching", "--max-num-seqs", "4",
                           "--kv-cache-gib", "0.5", "--preemption-mode", "swap", "--swap-space-gib", "1"])
    assert (router.port, router.api_key, router.host) == (9000, "k" * 16, "127.0.0.1")
    engine = args.engine_config()
    assert (engine.model, engine.max_model_len) == ("/m", 128)
    assert (engine.cache.num_blocks, engine.cache.enable_prefix_caching, engine.cache.kv_cache_gib) == (32, False, 0.5)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.preemption_mode) == (4, "swap")


def test_nodes_take_every_engine_flag_under_the_same_name():
    """A node's CLI takes every EngineArgs flag (max_model_len, prefix caching, chunked prefill,
    swap, preemption mode included) and its own; pdserve up passes them on unchanged."""
    config = NodeConfig.from_argv("node", ["--router", "tcp://127.0.0.1:1", "--node-id", "d", "--max-model-len", "64",
                                           "--no-enable-chunked-prefill", "--preemption-mode", "recompute",
                                           "--num-blocks", "8", "--heartbeat-s", "0.25"])
    assert (config.max_model_len, config.enable_chunked_prefill, config.preemption_mode, config.num_blocks,
            config.heartbeat_s) == (64, False, "recompute", 8, 0.25)
    assert config.engine_config().scheduler.enable_chunked_prefill is False
    capped = NodeConfig.from_argv("node", ["--router", "tcp://127.0.0.1:1", "--node-id", "d",
                                           "--long-prefill-token-threshold", "32"])
    assert capped.engine_config().scheduler.long_prefill_token_threshold == 32
    from router.launcher import parse_up
    up = parse_up(["up", "--no-enable-prefix-caching", "--max-num-seqs", "3", "--port", "1234",
                   "--long-prefill-token-threshold", "32"])
    assert up.node_flags == ["--no-enable-prefix-caching", "--max-num-seqs", "3", "--long-prefill-token-threshold", "32"]
    assert up.router.port == 1234


def test_every_flag_has_a_one_line_description():
    """Each field of every config record that becomes a flag has a help line (its comment)."""
    for cls in (RouterConfig, ClusterConfig, NodeConfig, EngineArgs):
        helps = field_help(cls)
        missing = [name for name in cls.__dataclass_fields__ if not helps.get(name)]
        assert missing == [], f"{cls.__name__}: {missing}"
    up_help = _parser()._subparsers._group_actions[0].choices["up"].format_help()
    assert "sequences running in one step" in up_help and "the HTTP port" in up_help


def test_invalid_values_are_refused():
    """Config validation runs on flag values."""
    with pytest.raises(ValueError, match="port"):
        _parse(["--port", "70000"])


def test_port_in_use_exits_at_once_with_one_line(monkeypatch):
    """python -m router on a taken port: exit status 1 with one line, before the engine loads."""
    import socket

    import engine.llm_engine
    from router.cli import main

    monkeypatch.setattr(engine.llm_engine, "LLMEngine", _must_not_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["--port", str(port), "--model", "/nonexistent"])
    message = exit_.value.code
    assert message.startswith(f"pdserve: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "\n" not in message


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the port was checked")


def test_keys_come_from_the_environment_not_the_command_line(monkeypatch, caplog):
    """With no key flags, the router's API, admin and metrics keys come from $PDSERVE_API_KEY,
    $PDSERVE_ADMIN_KEY and $PDSERVE_METRICS_KEY (a flag's value is in /proc/PID/cmdline, which
    every local user reads); a key flag still wins, with a warning that names its variable."""
    from router.launcher import parse_up
    monkeypatch.setenv("PDSERVE_API_KEY", "api-key-from-env-0")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "admin-key-from-env-0")
    monkeypatch.setenv("PDSERVE_METRICS_KEY", "metrics-key-from-env-0")
    router = parse_up(["up"]).router
    assert (router.api_key, router.admin_api_key, router.metrics_api_key) == ("api-key-from-env-0", "admin-key-from-env-0", "metrics-key-from-env-0")
    assert not caplog.records
    assert parse_up(["up", "--admin-api-key", "admin-key-from-flag"]).router.admin_api_key == "admin-key-from-flag"
    assert "$PDSERVE_ADMIN_KEY" in caplog.text


def test_a_short_key_stops_the_router_at_startup(monkeypatch, capsys):
    """A key under 16 characters, from a flag or the environment, is a usage error (status 2) that
    names the key and the minimum; the router does not start (any key was accepted, "a" included)."""
    from router.launcher import parse_up
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "admin")
    with pytest.raises(SystemExit) as exited:
        parse_up(["up"])
    assert exited.value.code == 2
    assert "--admin-api-key or $PDSERVE_ADMIN_KEY) is 5 characters; a key must have at least 16" in capsys.readouterr().err


def test_nodes_do_not_inherit_the_routers_keys(monkeypatch):
    """A node process (spawned here or by a Ray actor) gets the cluster secret but none of the
    router's HTTP keys: no node needs them, and a node's environment is one more place to read them."""
    from ray_deploy.node_actor import NodeLaunch, _node_env
    from router.config import KEY_VARIABLES
    from router.node_processes import ClusterConfig, NodeSpawner
    for variable in KEY_VARIABLES.values():
        monkeypatch.setenv(variable, "secret-" + variable)
    monkeypatch.setenv("PDSERVE_UNRELATED", "kept")
    local = NodeSpawner("tcp://127.0.0.1:1", ClusterConfig(), [], b"\x01" * 32)._base
    ray = _node_env(NodeLaunch("decode", "decode-0", "tcp://127.0.0.1:1", (), "secret-ref", 1), "01" * 32)
    for env in (local, ray):
        assert not set(KEY_VARIABLES.values()) & env.keys()
        assert env["PDSERVE_UNRELATED"] == "kept"
