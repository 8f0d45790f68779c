"""Validate a JSON value against a JSON schema: with `jsonschema` when it is installed, else with
a strict check of the keywords the structured-output tests use (any other keyword fails loudly)."""
from __future__ import annotations

from typing import Any

_KNOWN = {"type", "properties", "required", "additionalProperties", "enum", "const", "minimum", "maximum",
          "minLength", "maxLength", "items", "minItems", "maxItems", "anyOf", "description", "title"}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def validate(value: Any, schema: dict) -> None:
    """Raises AssertionError (or jsonschema's ValidationError) if value does not follow schema."""
    try:
        import jsonschema
    except ImportError:
        return _check(value, schema, "$")
    jsonschema.validate(value, schema)


def _check(value: Any, schema: dict, at: str) -> None:
    assert set(schema) <= _KNOWN, f"{at}: the strict check does not know {set(schema) - _KNOWN}"
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                return _check(value, option, at)
            except AssertionError as err:
                errors.append(str(err))
        raise AssertionError(f"{at}: matches no anyOf option: {errors}")
    _check_type(value, schema.get("type"), at)
    assert "enum" not in schema or value in schema["enum"], f"{at}: {value!r} not in {schema['enum']}"
    assert "const" not in schema or value == schema["const"], f"{at}: {value!r} != {schema['const']!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert value >= schema.get("minimum", value) and value <= schema.get("maximum", value), f"{at}: {value}"
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), f"{at}: {value!r}"
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{at}: {value!r}"
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{at}[{i}]")
    if isinstance(value, dict):
        _check_object(value, schema, at)


def _check_type(value: Any, kind: str | None, at: str) -> None:
    if kind is None:
        return
    if kind == "integer":
        assert type(value) is int, f"{at}: {value!r} is not an integer"
    elif kind == "number":
        assert type(value) in (int, float), f"{at}: {value!r} is not a number"
    else:
        assert type(value) is _TYPES[kind], f"{at}: {value!r} is not {kind}"


def _check_object(value: dict, schema: dict, at: str) -> None:
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        assert name in value, f"{at}: {name!r} is missing"
    if schema.get("additionalProperties") is False:
        assert set(value) <= set(props), f"{at}: extra keys {set(value) - set(props)}"
    for name, item in value.items():
        if name in props:
            _check(item, props[name], f"{at}.{name}")
