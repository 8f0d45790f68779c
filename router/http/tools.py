"""Tool calls on /v1/chat/completions, in OpenAI's shape.

    tool_choice          what the model is held to                   the answer
    "none" / no tools    nothing                                     content
    {"function": f}      f's parameters (a JSON schema)              one call of f
    "required"           [{"name": t, "arguments": t's params}, ...]  one call per item
                         (anyOf over the tools; one item unless
                         parallel_tool_calls)
    "auto"               nothing: the chat template shows the tools  Hermes-style
                         and the model may answer                     <tool_call>{"name", "arguments"}</tool_call>
                                                                      blocks become calls, the rest content

"auto" needs a template that renders `tools` (else the model never hears of them: a 400).
A call ends its choice with finish_reason "tool_calls".
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from pdwire.structured_output import StructuredOutput

_STRICT = ConfigDict(extra="ignore", strict=True)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict | None = None      # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef

    def template_dict(self) -> dict:
        return self.model_dump(exclude_none=True)


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str                      # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolMode(NamedTuple):
    """How a request's tools are used; None (no ToolMode) when they are not."""
    choice: Literal["named", "required", "auto"]
    tools: tuple[ToolDef, ...]
    name: str | None = None             # "named": the function
    parallel: bool = True               # "required": more than one call allowed


def tool_mode(tools: list[ToolDef] | None, choice: Any, parallel: bool | None) -> ToolMode | None:
    """Raises ValueError for a choice that names no given tool, or tools without a choice's need."""
    if choice == "none" or (not tools and choice is None):
        return None
    if not tools:
        raise ValueError("tool_choice needs tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools must have distinct function names")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        return ToolMode("named", tuple(tools), choice.function.name)
    return ToolMode("required" if choice == "required" else "auto", tuple(tools), parallel=parallel is not False)


def tool_grammar(mode: ToolMode) -> StructuredOutput | None:
    """The grammar the output is held to ("auto": none)."""
    if mode.choice == "named":
        return StructuredOutput.json_schema(_parameters(_tool(mode, mode.name)))
    if mode.choice == "auto":
        return None
    item = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                        "arguments": _parameters(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in mode.tools]}
    array = {"type": "array", "items": item, "minItems": 1}
    if not mode.parallel:
        array["maxItems"] = 1
    return StructuredOutput.json_schema(array)


def split_calls(text: str, mode: ToolMode) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished choice's text. Text that does not parse (a choice cut
    by max_tokens) stays content, with no calls."""
    if mode.choice == "named":
        return None, [_call(mode.name, text)]
    if mode.choice == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [_call(i["name"], json.dumps(i["arguments"])) for i in items]
    return _hermes(text)


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        arguments = call.get("arguments", {})
        calls.append(_call(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    content = _HERMES.sub("", text).strip() if calls else text
    return content or None, calls


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(name=name, arguments=arguments))


def _tool(mode: ToolMode, name: str) -> ToolDef:
    return next(t for t in mode.tools if t.function.name == name)


def _parameters(tool: ToolDef) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}
