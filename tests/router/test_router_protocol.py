"""OpenAI protocol models, prompt checks and SSE framing, without HTTP."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdwire.sampling_params import SamplingParams
from router.http.errors import OpenAIError, from_value_error
from router.http.prompts import completion_prompts, max_tokens_for
from router.http.protocol import (ChatCompletionRequest, ChatCompletionChunk, ChatStreamChoice, CompletionRequest,
                             DeltaMessage)
from router.http.streaming import sse


class Tok:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def __len__(self):
        return 1000


def test_defaults_map_to_engine_defaults():
    """A bare request maps to SamplingParams' own defaults, with the given max_tokens."""
    req = CompletionRequest(prompt="x")
    assert req.sampling_params(16, None) == SamplingParams(max_tokens=16)


def test_nulls_mean_defaults():
    """Explicit JSON nulls for sampling fields fall back to the defaults."""
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": None, "top_p": None, "stop": None})
    assert req.sampling_params(None, None) == SamplingParams(max_tokens=None)


def test_stop_string_and_list():
    """stop accepts one string or a list of strings."""
    assert CompletionRequest(prompt="x", stop="a").sampling_params(1, None).stop == ("a",)
    assert CompletionRequest(prompt="x", stop=["a", "b"]).sampling_params(1, None).stop == ("a", "b")
    assert CompletionRequest(prompt="x", stop="a", include_stop_str_in_output=True).sampling_params(
        1, None).include_stop_str_in_output


def test_max_completion_tokens_wins():
    """max_completion_tokens overrides max_tokens."""
    assert CompletionRequest(prompt="x", max_tokens=3, max_completion_tokens=5).requested_max_tokens() == 5
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=3).requested_max_tokens() == 3


def test_out_of_range_values_raise_value_error():
    """SamplingParams' range checks surface as ValueError naming the field."""
    with pytest.raises(ValueError, match="^top_p"):
        CompletionRequest(prompt="x", top_p=2).sampling_params(1, None)
    with pytest.raises(ValueError, match="logit_bias"):
        CompletionRequest(prompt="x", logit_bias={"1": 2.0}).sampling_params(1, None)


def test_unsupported_fields_are_refused():
    """suffix and best_of > 1 are refused rather than silently ignored."""
    for extra in ({"suffix": "s"}, {"best_of": 2}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", **extra})


def test_unknown_fields_are_ignored():
    """Fields the server does not know (and that change nothing) are accepted."""
    assert CompletionRequest.model_validate({"prompt": "x", "service_tier": "auto"}).prompt == "x"


def test_chat_logprobs_count():
    """Chat logprobs=true gives top_logprobs (default 0); top_logprobs alone is refused."""
    msgs = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=msgs).logprobs_count() is None
    assert ChatCompletionRequest(messages=msgs, logprobs=True).logprobs_count() == 0
    assert ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=3).logprobs_count() == 3
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=msgs, top_logprobs=3).logprobs_count()


def test_chat_message_text_parts_joined():
    """A message's text parts are joined with newlines for the chat template."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.messages[0].template_dict() == {"role": "user", "content": "a\nb"}


def test_completion_prompt_shapes():
    """String, batch of strings, token ids and batch of token ids all become token-id lists."""
    tok = Tok()
    assert completion_prompts(tok, CompletionRequest(prompt="ab")) == [[97, 98]]
    assert completion_prompts(tok, CompletionRequest(prompt=["a", "b"])) == [[97], [98]]
    assert completion_prompts(tok, CompletionRequest(prompt=[5, 6])) == [[5, 6]]
    assert completion_prompts(tok, CompletionRequest(prompt=[[5], [6, 7]])) == [[5], [6, 7]]


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", ""], [1000], [-1]])
def test_bad_prompts_raise_400(prompt):
    """Empty prompts and out-of-vocabulary token ids are a 400 on param prompt."""
    with pytest.raises(OpenAIError) as info:
        completion_prompts(Tok(), CompletionRequest(prompt=prompt))
    assert info.value.status == 400 and info.value.info.param == "prompt"


def test_max_tokens_for():
    """Requested max_tokens must fit the context; a default is clamped; None runs to the end."""
    assert max_tokens_for(10, 5, 16, 20) == 5
    assert max_tokens_for(10, None, 16, 20) == 10
    assert max_tokens_for(10, None, None, 20) is None
    with pytest.raises(OpenAIError, match="maximum context length is 20"):
        max_tokens_for(10, 11, 16, 20)
    with pytest.raises(OpenAIError, match="prompt has 20 tokens"):
        max_tokens_for(20, None, 16, 20)


def test_value_error_param_detection():
    """A ValueError becomes a 400 whose param is the field its message starts with, if any."""
    assert from_value_error(ValueError("n must be >= 1"), {"n", "prompt"}).info.param == "n"
    assert from_value_error(ValueError("oops"), {"n"}).info.param is None


def test_sse_framing_and_delta_nulls():
    """An SSE event is `data: <json>` plus a blank line; a delta omits its null fields."""
    chunk = ChatCompletionChunk(id="c", created=1, model="m",
                                choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content="x"))])
    assert sse(chunk, exclude={"usage"}) == (
        'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        '[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null}]}\n\n')
