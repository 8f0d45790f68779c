"""A structured-output request as data: what the output must match (a JSON schema, any JSON
object, a regular expression, one of a few strings, or an EBNF grammar) and its text.

It travels inside SamplingParams as `[kind, spec]`, never as a compiled object: each node
compiles it with its own grammar library (engine/grammar.py) and replays the tokens generated so
far into a fresh matcher, so a request moved to another node continues from the same state.
"""
from __future__ import annotations

import enum
import itertools
import json
import re
from dataclasses import dataclass

MAX_SPEC_CHARS = 1 << 20     # the wire's hard cap; the router's --max-grammar-chars is lower
MAX_SPEC_DEPTH = 128         # the wire's cap on a JSON spec's nesting; the router's --max-grammar-depth is lower
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')     # possessive: linear on an unclosed string
_NOT_BRACKET = re.compile(r"[^\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"     # spec: a JSON schema's text
    JSON_OBJECT = "json_object"     # spec: "" (any JSON object)
    REGEX = "regex"                 # spec: a regular expression the whole output matches
    CHOICE = "choice"               # spec: a JSON list of strings; the output is one of them
    GRAMMAR = "grammar"             # spec: an EBNF grammar (GBNF dialect, root rule `root`)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: GrammarKind
    spec: str

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GrammarKind(self.kind))
        except ValueError:
            raise ValueError(f"structured output kind must be one of {[k.value for k in GrammarKind]}, "
                             f"got {self.kind!r}") from None
        if type(self.spec) is not str or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output's spec must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind is GrammarKind.CHOICE:
            choices = _loads(self.spec, "choice")
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.kind is GrammarKind.JSON_SCHEMA and not isinstance(_loads(self.spec, "json_schema"), dict):
            raise ValueError("a JSON schema must be a JSON object")

    @classmethod
    def choice(cls, options: list[str]) -> "StructuredOutput":
        return cls(GrammarKind.CHOICE, json.dumps(list(options)))

    @classmethod
    def json_schema(cls, schema: dict | str) -> "StructuredOutput":
        return cls(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    def to_wire(self) -> list[str]:
        return [self.kind.value, self.spec]

    @classmethod
    def from_wire(cls, value: object) -> "StructuredOutput":
        if isinstance(value, StructuredOutput):
            return value
        if type(value) not in (list, tuple) or len(value) != 2:
            raise ValueError("a structured output travels as [kind, spec]")
        return cls(*value)


def json_depth(text: str) -> int:
    """How deep a JSON text's arrays and objects nest (brackets outside strings), without parsing
    it: xgrammar's time on a JSON schema grows with the cube of its depth (1,000 nested `items`,
    25 kB, held a thread for a minute), and json.loads raises RecursionError past ~1,000."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _loads(text: str, what: str) -> object:
    if (depth := json_depth(text)) > MAX_SPEC_DEPTH:
        raise ValueError(f"{what} nests {depth} deep, over the limit of {MAX_SPEC_DEPTH}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} is not valid JSON: {err}") from None
