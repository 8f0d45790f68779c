"""Structured output at the HTTP edge: OpenAI's `response_format` and vLLM's extra parameters
(`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and their newer form
`structured_outputs: {json, regex, choice, grammar}`) become one StructuredOutput, which
router/http/limits.py checks against --max-grammar-chars and then parses (off the event loop) with
the grammar library: a grammar that does not parse is a 400 at the edge, not a failure on a node.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdwire.structured_output import GrammarKind, StructuredOutput

_STRICT = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str
    json_schema: dict = Field(alias="schema", default_factory=dict)   # {} (no schema): any JSON object
    strict: bool | None = None          # strict or not, the output follows the schema
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` (exactly one field set)."""
    model_config = _STRICT
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredFields(BaseModel):
    """The request fields that ask for a structured output (both endpoints)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_whitespace_pattern: None = None         # refused: the library's JSON whitespace rule applies

    def structured_output(self) -> StructuredOutput | None:
        """The one structured output asked for, or None. Raises ValueError if more than one
        field asks, or a value is malformed."""
        asked = {name: spec for name, spec in self._candidates() if spec is not None}
        if len(asked) > 1:
            raise ValueError(f"{' and '.join(sorted(asked))} each ask for a structured output: give one")
        return next(iter(asked.values()), None)

    def _candidates(self) -> list[tuple[str, StructuredOutput | None]]:
        so = self.structured_outputs
        return [("response_format", _from_response_format(self.response_format)),
                ("guided_json", _json(self.guided_json)), ("guided_regex", _regex(self.guided_regex)),
                ("guided_choice", _choice(self.guided_choice)), ("guided_grammar", _grammar(self.guided_grammar)),
                ("structured_outputs", _from_structured_outputs(so) if so is not None else None)]


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(GrammarKind.JSON_OBJECT, "")
    if fmt.json_schema is None:
        raise ValueError("response_format of type json_schema needs a json_schema")
    schema = fmt.json_schema.json_schema
    return StructuredOutput.json_schema(schema) if schema else StructuredOutput(GrammarKind.JSON_OBJECT, "")


def _from_structured_outputs(so: StructuredOutputsParams) -> StructuredOutput | None:
    asked = [s for s in (_json(so.json_), _regex(so.regex), _choice(so.choice), _grammar(so.grammar)) if s]
    if len(asked) != 1:
        raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar")
    return asked[0]


def _json(value: dict | str | None) -> StructuredOutput | None:
    return None if value is None else StructuredOutput.json_schema(value)


def _regex(value: str | None) -> StructuredOutput | None:
    return None if value is None else StructuredOutput(GrammarKind.REGEX, value)


def _choice(value: list[str] | None) -> StructuredOutput | None:
    return None if value is None else StructuredOutput.choice(value)


def _grammar(value: str | None) -> StructuredOutput | None:
    return None if value is None else StructuredOutput(GrammarKind.GRAMMAR, value)


