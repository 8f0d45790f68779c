"""OpenAI wire format: request and response models for /v1/completions and /v1/chat/completions.

Requests ignore unknown fields (clients send many) but refuse the ones whose meaning we would
silently change (suffix, best_of, logit_bias, guided_whitespace_pattern). Structured outputs
(router/http/structured.py) and tools (router/http/tools.py) have their own modules.
`sampling_params()` maps a request to the engine's SamplingParams, which does the range checks
and raises ValueError.
"""
from __future__ import annotations

import enum
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_serializer, model_validator

from pdwire.sampling_params import SamplingParams
from pdwire.structured_output import StructuredOutput
from router.http.structured import StructuredFields
from router.http.tools import NamedToolChoice, ToolCall, ToolDef, ToolMode, tool_grammar, tool_mode


# strict: a bool is not an int, a string is not a number or a bool (`"n": "2"` is refused)
_REQUEST = ConfigDict(extra="ignore", strict=True)


class StreamUsage(enum.Enum):
    """Where a stream reports usage."""
    NONE = "none"               # nowhere
    FINAL = "final"             # one last chunk with no choices (include_usage)
    CONTINUOUS = "continuous"   # that, and every chunk with the usage so far (+ continuous_usage_stats)


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: with include_usage, every chunk carries the usage so far


class _SamplingRequest(StructuredFields):
    """Fields shared by both endpoints; None means "the default"."""
    model_config = _REQUEST

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None       # OpenAI's newer name; wins over max_tokens
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                       # extension
    min_p: float | None = None                     # extension
    n: int = Field(1, ge=1)                        # at most --max-n (router/http/limits.py)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None        # extension
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None        # extension
    min_tokens: int = 0                            # extension
    ignore_eos: bool = False                       # extension
    include_stop_str_in_output: bool = False       # extension (vLLM's): the stop string stays in the text
    use_beam_search: bool = False                  # extension: beam search, width beam_width or n
    beam_width: int | None = None                  # extension
    length_penalty: float = 1.0                    # extension (beam search)
    early_stopping: bool | Literal["never"] = False  # extension (beam search)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                        # accepted, ignored
    logit_bias: dict[str, float] | None = None     # refused unless empty

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stream_usage(self) -> StreamUsage:
        if not self.include_usage:
            return StreamUsage.NONE
        return StreamUsage.CONTINUOUS if self.stream_options.continuous_usage_stats else StreamUsage.FINAL

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """Raises ValueError on any out-of-range value."""
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty)
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=_as_tuple(self.stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            beam_width=(self.beam_width or self.n) if self.use_beam_search else 0,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping, structured=structured,
            **{k: v for k, v in given.items() if v is not None})


class CompletionRequest(_SamplingRequest):
    # one string, a batch of strings, one token-id prompt, or a batch of token-id prompts
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False      # each choice's text starts with the prompt (with logprobs: its tokens' too)
    suffix: None = None
    best_of: Literal[1] | None = None


class TextPart(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQUEST
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None                # a tool message: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    @property
    def uses_tools(self) -> bool:
        return bool(self.tool_calls) or self.role == "tool"

    def template_dict(self) -> dict:
        """The message as a chat template expects it: text parts joined with newlines; an
        assistant's calls with their arguments parsed (as Hermes-style templates read them)."""
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        out: dict = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                          "arguments": _parsed(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # None: "auto" with tools
    parallel_tool_calls: bool | None = None
    functions: None = None                         # refused: OpenAI's deprecated form of tools
    function_call: None = None

    def tool_mode(self) -> ToolMode | None:
        """Raises ValueError for tools this server cannot honour as asked."""
        mode = tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls)
        if mode is not None and self.logprobs:
            raise ValueError("logprobs is not returned with tool calls: ask for one or the other")
        if mode is not None and mode.choice != "auto" and super().structured_output() is not None:
            raise ValueError(f"tool_choice {mode.choice!r} holds the output to the tool's arguments: "
                             "it cannot be combined with response_format or guided_* as well")
        return mode

    def structured_output(self) -> StructuredOutput | None:
        mode = self.tool_mode()
        return tool_grammar(mode) if mode is not None and mode.choice != "auto" else super().structured_output()

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _as_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ---------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)          # None: the first
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)  # prompt token (echo)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (streaming) one chunk of it: OpenAI uses one object type for both."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)    # absent from the JSON when empty, as OpenAI's

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: Any) -> dict:
        out = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None        # [{index, id, type, function: {name, arguments}}]


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
