"""Turning a request's prompt into token ids, and checking them against the model's context.

These run on a worker thread (router/http/workers.py): the tokenizer comes first, as Workers.run passes it.
"""
from __future__ import annotations

from typing import Any

from router.http.chat_template import render_chat, renders_tools
from router.http.errors import bad_request
from router.http.protocol import ChatCompletionRequest, CompletionRequest
from router.http.tools import ToolMode


def completion_prompts(tokenizer: Any, request: CompletionRequest) -> list[list[int]]:
    """One token-id list per prompt of the batch. Raises a 400 for an empty prompt or bad ids."""
    prompt = _batch(request.prompt)
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return [_tokenize(p, tokenizer) for p in prompt]


def echo_texts(tokenizer: Any, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What `echo` puts before each prompt's choices: the prompt as given, or its token ids decoded."""
    return [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(_batch(request.prompt), prompts)]


def _batch(prompt: Any) -> list:
    """The request's prompts as a list: one string or one token-id list is a batch of one."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt


def chat_prompt(tokenizer: Any, request: ChatCompletionRequest, trust_control_tokens: bool,
                tools: ToolMode | None = None) -> list[int]:
    """The conversation rendered by the model's chat template, ready for the assistant's turn,
    with the tools when the template renders them. Control strings typed in a message stay text
    unless `trust_control_tokens`. "auto" tools with a template that cannot show them are a 400."""
    messages = [m.template_dict() for m in request.messages]
    shown = None
    if tools is not None and renders_tools(tokenizer):
        shown = [t.template_dict() for t in tools.tools]
    elif tools is not None and tools.choice == "auto":
        raise bad_request("tool_choice \"auto\" needs a chat template that renders tools, and this model's "
                          "does not: name a function in tool_choice, or use \"required\"", "tool_choice")
    try:
        return render_chat(tokenizer, messages, trust_control_tokens, shown)
    except ValueError as err:
        raise bad_request(str(err), "messages") from err
    except Exception as err:    # noqa: BLE001 -- no template, or the template raised (jinja)
        raise bad_request(f"cannot apply the chat template: {str(err)[:200]}", "messages") from err


def max_tokens_for(prompt_len: int, requested: int | None, default: int | None,
                   max_model_len: int) -> int | None:
    """The max_tokens to run with. Raises a 400 if the prompt, or prompt + requested, overflows.

    A default (not requested) is clamped to the room left in the context; None means "to the end".
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, "
                          f"but the prompt has {prompt_len} tokens.", "prompt")
    if requested is None:
        return None if default is None else min(default, room)
    if requested > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, "
                          f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                          f"prompt, {requested} for the completion).", "max_tokens")
    return requested


def _tokenize(prompt: str | list[int], tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return tokenizer.encode(prompt)
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return list(prompt)
