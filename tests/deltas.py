"""Sums a backend's deltas (router/backend.py) back into whole outputs, for tests that assert on
what a client has been sent so far, and checks the delta contract on the way."""
from __future__ import annotations

from pdwire.outputs import CompletionOutput, RequestOutput


class Accumulator:
    def __init__(self) -> None:
        self.choices: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: list | None = None

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Takes one delta; returns the whole output so far (copies, in choice order)."""
        assert delta.prompt_logprobs is None or self.prompt_logprobs is None, "prompt logprobs sent twice"
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        for d in delta.outputs:
            whole = self.choices.setdefault(d.index, CompletionOutput(d.index, "", [], None, None))
            assert whole.finish_reason is None, f"choice {d.index} went on after its last delta"
            whole.text += d.text
            whole.token_ids = whole.token_ids + list(d.token_ids)
            if d.logprobs is not None:
                whole.logprobs = (whole.logprobs or []) + list(d.logprobs)
            whole.finish_reason = d.finish_reason
        return RequestOutput(delta.request_id, delta.prompt_token_ids,
                             [CompletionOutput(c.index, c.text, list(c.token_ids),
                                               None if c.logprobs is None else list(c.logprobs), c.finish_reason)
                              for _, c in sorted(self.choices.items())],
                             delta.finished, self.prompt_logprobs, delta.num_cached_tokens, delta.queue_time)
