"""ColocatedBackend over HTTP with a real engine (a tiny chat model): greedy parity, stop strings,
chat, aborts on disconnect, cached-token usage."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from pdwire.sampling_params import SamplingParams
from router.colocated import ColocatedBackend
from tests.http_helpers import UNCACHED


HANG_S = 120.0      # only bounds a hang: a starved 2-core machine is slow, never this slow


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


def _engine_whole(engine, prompt: list[int], params: SamplingParams):
    """The engine's own final output, stepped by hand on this thread."""
    engine.add_request("reference", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def _engine_greedy(engine, prompt: list[int], max_tokens: int):
    """The engine's own greedy answer."""
    return _engine_whole(engine, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)).outputs[0]


def test_streamed_greedy_completion_matches_engine(real_engine):
    """A greedy streamed completion through the app equals the engine's own greedy output, token for
    token, with exact usage; blocks are conserved afterwards."""
    from fastapi.testclient import TestClient

    from router.http.app import create_app

    engine = real_engine
    prompt_ids = engine.tokenizer.encode("hello world, the quick brown fox")
    reference = _engine_greedy(engine, prompt_ids, 12)
    backend = ColocatedBackend(engine)
    try:
        client = TestClient(create_app(backend))
        with client.stream("POST", "/v1/completions", json={
                "prompt": "hello world, the quick brown fox", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            body = r.read().decode()
        chunks = [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in body.strip().split("\n\n")]
        assert chunks[-1] == "[DONE]"
        usage, text_chunks = chunks[-2], chunks[:-2]
        assert usage["choices"] == [] and usage["usage"] == {
            "prompt_tokens": len(prompt_ids), "completion_tokens": 12, "total_tokens": len(prompt_ids) + 12,
            **UNCACHED}
        tokens = [t for c in text_chunks for t in c["choices"][0]["logprobs"]["tokens"]]
        assert tokens == [engine.tokenizer.decode([t]) for t in reference.token_ids]
        assert "".join(c["choices"][0]["text"] for c in text_chunks) == reference.text
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"

        async def direct():
            return [o async for o in backend.generate("direct", prompt_ids, SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True))]

        deltas = run(direct())
        assert [t for o in deltas for c in o.outputs for t in c.token_ids] == reference.token_ids
        assert "".join(c.text for o in deltas for c in o.outputs) == reference.text
    finally:
        backend.close()
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_streamed_text_never_shows_part_of_a_stop_string(real_engine):
    """A stop string taken from the middle of the greedy answer: every streamed prefix is a prefix of
    the final text, which ends right before the stop string (the engine's own answer, cut)."""
    from fastapi.testclient import TestClient

    from router.http.app import create_app

    engine = real_engine
    prompt = "hello world, the quick brown fox"
    answer = _engine_greedy(engine, engine.tokenizer.encode(prompt), 24)
    reference = answer.text
    # a 2-character stop string across a token boundary: its first character comes a token early
    ends = [len(engine.tokenizer.decode(answer.token_ids[:i + 1])) for i in range(len(answer.token_ids))]
    cut = next(b for a, b, c in zip(ends, ends[1:], ends[2:]) if b > a and c > b
               and reference.find(reference[b - 1:b + 1]) == b - 1)
    stop = reference[cut - 1:cut + 1]
    final = reference[:cut - 1]
    backend = ColocatedBackend(engine)
    try:
        client = TestClient(create_app(backend))
        with client.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
                "stream": True}) as r:
            body = r.read().decode()
    finally:
        backend.close()
    chunks = [json.loads(e[6:]) for e in body.strip().split("\n\n") if e != "data: [DONE]"]
    streamed = ""
    for c in chunks:
        streamed += c["choices"][0]["text"]
        assert final.startswith(streamed), (streamed, final)
    assert streamed == final and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    engine.check_integrity()


def test_chat_and_abort_over_real_engine(real_engine):
    """A chat completion is answered with exact usage, and a generation left early is aborted
    with every block returned."""
    from fastapi.testclient import TestClient

    from router.http.app import create_app

    engine = real_engine
    backend = ColocatedBackend(engine)
    try:
        client = TestClient(create_app(backend))
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                        add_generation_prompt=True)
        prompt_len = len(engine.tokenizer.encode(rendered, add_special_tokens=False))
        assert r.json()["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5,
                                     "total_tokens": prompt_len + 5, **UNCACHED}
        assert client.post("/v1/completions", json={"prompt": "x" * 400}).status_code == 400

        async def leave_early():
            async for _ in backend.generate("early", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)):
                break
            while backend.metrics()[0].num_running:        # run() bounds the wait
                await asyncio.sleep(0.01)

        run(leave_early())
    finally:
        backend.close()
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_uvicorn_client_disconnect_aborts(real_engine, monkeypatch):
    """Over a real socket (uvicorn), a client that drops a stream or a plain request mid-generation
    gets its request aborted in the engine, counted as such, with every block returned."""
    import socket

    import httpx
    import uvicorn

    from router.http.app import create_app

    engine = real_engine
    real_step = engine.step

    def model_sized_step():     # the tiny model runs 240 tokens in under the client's 0.2 s: make
        time.sleep(0.005)       # each step last as a real model's, so the client leaves mid-generation
        return real_step()
    monkeypatch.setattr(engine, "step", model_sized_step)
    backend = ColocatedBackend(engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    payload = {"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True}
    try:
        deadline = time.monotonic() + HANG_S
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        with httpx.Client(base_url=base) as client:
            with client.stream("POST", "/v1/completions", json={**payload, "stream": True}) as r:
                next(r.iter_lines())   # the first chunk arrived, then the client hangs up
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=payload, timeout=0.2)
        with httpx.Client(base_url=base) as client:
            deadline = time.monotonic() + HANG_S
            while time.monotonic() < deadline:
                text = client.get("/metrics").text
                if f'pdserve_request_failure_total{{model_name="{backend.model_name}",reason="abort"}} 2.0' in text and \
                        backend.metrics()[0].num_running == 0:
                    break
                time.sleep(0.01)
        assert f'pdserve_request_failure_total{{model_name="{backend.model_name}",reason="abort"}} 2.0' in text
        assert "pdserve_request_success_total{" not in text
    finally:
        server.should_exit = True
        thread.join(10)
        backend.close()
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_repeated_prompt_reports_cached_tokens(real_engine):
    """A prompt sent again reports its prefix-cache hits in usage: whole blocks, below its length."""
    from fastapi.testclient import TestClient

    from router.http.app import create_app

    backend = ColocatedBackend(real_engine)
    prompt = list(range(3, 3 + 40))    # 40 tokens: two full blocks of 16 can hit
    try:
        client = TestClient(create_app(backend))
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        first = client.post("/v1/completions", json=body).json()["usage"]
        second = client.post("/v1/completions", json=body).json()["usage"]
        streamed = client.post("/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}).text
    finally:
        backend.close()
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 32}
    assert json.loads(streamed.split("\n\n")[-3][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    real_engine.check_integrity()
