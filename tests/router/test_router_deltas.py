"""Deltas only, bounded (issue #22): a Generation keeps only the backend's unsent deltas, at most
max_stream_buffer_bytes of them; echoed prompt logprobs are scored once."""
from __future__ import annotations

import asyncio
from unittest import mock

from fastapi.testclient import TestClient

import router.http.completions
from pdwire.outputs import CompletionOutput, RequestOutput
from pdwire.sampling_params import SamplingParams
from router.http.app import create_app
from router.config import RouterConfig
from router.http.lifecycle import Generation, StreamBufferFull
from router.http.metrics import RouterMetrics
from tests.fake_backend import FakeBackend


class Growing(FakeBackend):
    """Deltas of "abcdefgh" and one token per step, forever."""

    async def generate(self, request_id, prompt, params):
        try:
            while True:
                yield RequestOutput(request_id, prompt, [CompletionOutput(0, "abcdefgh", [7], None, None)], False)
                await asyncio.sleep(0)
        finally:
            self.aborted.append(request_id)


async def _unread(max_bytes: int, steps: int) -> tuple[Generation, Growing]:
    backend = Growing()
    generation = Generation(backend, RouterMetrics(backend), "r", [([1], SamplingParams(max_tokens=10))], max_bytes)
    await generation.start()
    for _ in range(steps):
        await asyncio.sleep(0)
    return generation, backend


def test_unread_output_is_kept_as_deltas():
    """A client that reads nothing holds 16 bytes per step (8 characters + 1 token id)."""
    async def check():
        generation, _ = await _unread(1 << 20, 50)
        buffered, items = generation._buffered, len(generation._items)
        await generation.close()
        return buffered, items
    buffered, items = asyncio.run(check())
    assert buffered == 16 * items                 # each queued delta: 8 characters + 1 token id
    assert items > 10


def test_a_full_buffer_ends_the_request_and_aborts_it():
    """Past max_stream_buffer_bytes the reader gets StreamBufferFull at once and the backend
    request is aborted; nothing stays buffered."""
    async def check():
        generation, backend = await _unread(160, 40)
        try:
            async for _ in generation.outputs():
                pass
        except StreamBufferFull as err:
            raised = err
        await generation.close()
        return raised, backend.aborted, generation._buffered
    raised, aborted, buffered = asyncio.run(check())
    assert "--max-stream-buffer-bytes" in str(raised) and aborted == ["r-0"] and buffered == 0


def test_echo_logprobs_are_scored_once_per_prompt():
    """n 4 choices of one echoed prompt: the prompt's logprobs are rendered once, not four times."""
    client = TestClient(create_app(FakeBackend(), RouterConfig()))
    with mock.patch.object(router.http.completions, "completion_logprobs",
                           wraps=router.http.completions.completion_logprobs) as rendered:
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "n": 4, "logprobs": 1,
                                                 "echo": True, "temperature": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    prompt_calls = [c for c in rendered.call_args_list if c.args[1] == [5, 6, 7]]
    assert len(prompt_calls) == 1 and rendered.call_count == 1 + 4
