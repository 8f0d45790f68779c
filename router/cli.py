"""`python -m router`: serve one model colocated (prefill + decode in this process) over HTTP.

Flags are generated from the config dataclasses, defaults included: RouterConfig's fields as
`--port`, `--api-key`, ...; EngineConfig's as `--model`, `--dtype`, and its nested configs with
their prefix, e.g. `--cache-num-blocks`, `--scheduler-max-num-seqs`.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Sequence

_SCALARS = (bool, int, float, str)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One flag per scalar field of `cls` (Optional allowed); nested dataclasses get a prefix."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = _scalar(hints[field.name])
        name = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(hints[field.name]):
            add_dataclass_args(parser, hints[field.name], f"{name}_")
        elif kind is bool:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"default: {_default(field)}")
        elif kind is not None:
            parser.add_argument(_flag(name), dest=name, type=kind, default=argparse.SUPPRESS,
                                help=f"default: {_default(field)}")


def build_dataclass(cls: type, args: dict[str, Any], prefix: str = "") -> Any:
    """The dataclass from the flags given; fields not given keep their defaults."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(hints[field.name]):
            kwargs[field.name] = build_dataclass(hints[field.name], args, f"{name}_")
        elif name in args:
            kwargs[field.name] = args[name]
    return cls(**kwargs)


def main(argv: Sequence[str] | None = None) -> None:
    from engine import EngineConfig, LLMEngine
    from router.app import create_app
    from router.colocated import ColocatedBackend
    from router.config import RouterConfig
    from router.server import Server

    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__.splitlines()[0])
    add_dataclass_args(parser, RouterConfig)
    add_dataclass_args(parser, EngineConfig)
    args = vars(parser.parse_args(argv))
    config = build_dataclass(RouterConfig, args)
    backend = ColocatedBackend(LLMEngine(build_dataclass(EngineConfig, args)))
    try:
        Server(create_app(backend, config), config, loop="uvloop").run()
    finally:
        backend.close()


def _scalar(hint: Any) -> type | None:
    """int for `int` or `int | None`; None for anything else."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = [a for a in args if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in _SCALARS else None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return "(computed)"
