"""A deterministic fake Backend for the router's HTTP tests: one character per token, scripted
failures picked by the prompt text."""
from __future__ import annotations

import asyncio

from pdwire.outputs import CompletionOutput, RequestOutput
from pdwire.sampling_params import SamplingParams
from router.backend import Backend, NodeMetrics
from router.stop_hold import StopHold

REPLY = "hello world"   # what choice 0 says; choice 1 says it in upper case
MODEL = "fake-model"


class CharTokenizer:
    """One token per character, id = code point; a bracketed chat template."""

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return 0x110000

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False) -> str:
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


class FakeBackend(Backend):
    """Emits REPLY one character per step, as deltas cut by StopHold like the real backends'; the
    prompt text picks special behaviour:
    "reject" raises ValueError, "hang" stops after one token until cancelled, "fail" raises midway."""

    def __init__(self, max_model_len: int = 64):
        self._max_model_len = max_model_len
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.hanging = asyncio.Event()

    @property
    def model_name(self) -> str:
        return MODEL

    @property
    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer()

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate(self, request_id, prompt, params):
        self.requests.append((request_id, prompt, params))
        text = CharTokenizer().decode(prompt)
        if "reject" in text:
            raise ValueError("prompt rejected by the engine")
        finished = False
        try:
            replies = [REPLY.upper() if i % 2 else REPLY for i in range(params.n)]
            holds = [StopHold(i, params) for i in range(params.n)]
            steps = min(len(REPLY), params.max_tokens or len(REPLY))
            for step in range(1, steps + 1):
                if step == 2 and "hang" in text:
                    self.hanging.set()
                    await asyncio.Event().wait()
                if step == 3 and "fail" in text:
                    raise RuntimeError("engine exploded")
                finished = step == steps
                reason = ("length" if steps < len(REPLY) else "stop") if finished else None
                prompt_logprobs = None if params.prompt_logprobs is None or step > 1 else \
                    [None] + [{t: -0.25, t + 1: -2.0} for t in prompt[1:]]
                for i, r in enumerate(replies):
                    holds[i].advance_to(_completion(i, r[:step], reason, params))
                yield RequestOutput(request_id, list(prompt), [d for h in holds if (d := h.take()) is not None],
                                    finished, prompt_logprobs)
                await asyncio.sleep(0)
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def metrics(self):
        return [NodeMetrics("colocated", "colocated", 2, 1, 0.25, 0.5, 3)]


def _completion(index, text, reason, params) -> CompletionOutput:
    ids = [ord(c) for c in text]
    logprobs = None
    if params.logprobs is not None:
        logprobs = [{t: -0.5, t + 1: -1.5} for t in ids]
    return CompletionOutput(index, text, ids, logprobs, reason)
