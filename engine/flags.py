"""Command-line flags generated from config dataclasses: one flag per scalar field, named after
it (`max_num_seqs` -> `--max-num-seqs`), its help the comment that follows the field in the
source, so a config record is the one place a knob is named, defaulted and described.
Nested dataclasses get their field name as a prefix. Imports nothing heavy.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import Any

_SCALARS = (bool, int, float, str)
_FIELD_LINE = re.compile(r"^\s+(\w+)\s*:[^#]*#\s?(.*)$")
_MORE_LINE = re.compile(r"^\s+#\s?(.*)$")


def add_dataclass_args(parser: argparse.ArgumentParser | Any, cls: type, prefix: str = "",
                       dest_prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """One flag per scalar field of `cls` (Optional allowed) not in `skip`; a field without a
    default is required. Values land under dest_prefix + name; unset flags are absent."""
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        if field.name in skip:
            continue
        if dataclasses.is_dataclass(hints[field.name]):
            add_dataclass_args(parser, hints[field.name], f"{name}_", dest_prefix, skip)
            continue
        kind = _scalar(hints[field.name])
        if kind is None:
            continue
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        text = helps.get(field.name, "") + ("" if required else f" (default: {field.default})")
        options = dict(dest=dest_prefix + name, help=text.strip(), default=argparse.SUPPRESS)
        if kind is bool:
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **options)
        else:
            parser.add_argument(_flag(name), type=kind, required=required, metavar=name.upper(), **options)


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


def to_argv(config: Any, prefix: str = "") -> list[str]:
    """The flags that rebuild `config` (build_dataclass's inverse): one per scalar field that
    differs from its default."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        name, value = f"{prefix}{field.name}", getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            argv += to_argv(value, f"{name}_")
        elif isinstance(value, _SCALARS) and value != field.default:
            argv += [_flag(name)] if value is True else [f"--no-{_flag(name)[2:]}"] if value is False \
                else [_flag(name), str(value)]
    return argv


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Each field's help: the comment after it in the class source (and comment-only lines
    right below it), for cls and the dataclasses it extends."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        current = None
        for line in inspect.getsource(klass).splitlines():
            if m := _FIELD_LINE.match(line):
                current, helps[m.group(1)] = m.group(1), m.group(2).strip()
            elif current and (m := _MORE_LINE.match(line)):
                helps[current] += " " + m.group(1).strip()
            else:
                current = None
    return helps


def _scalar(hint: Any) -> type | None:
    """int for `int` or `int | None`; None for anything else."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = [a for a in args if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in _SCALARS else None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
