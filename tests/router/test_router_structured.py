"""Structured output and tools over HTTP (colocated, a real engine on a tiny chat model): every
answer parses and validates against its schema; tool calls come back in OpenAI's shape, whole and
streamed, read by the official `openai` client; what cannot be honoured is a 400 before any work."""
from __future__ import annotations

import json
import re

import pytest

from router.colocated import ColocatedBackend
from router.config import RouterConfig
from tests.schema_check import validate
from tests.tiny_chat_model import tiny_chat_model_folder

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["city", "days", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOL_TEMPLATE = ("{% if tools %}<s>system: you may call {{ tools | tojson }}\n{% endif %}"
                 "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
ASK = [{"role": "user", "content": "weather in paris?"}]


def _engine(path):
    from engine import CacheConfig, EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                  cache=CacheConfig(block_size=16, num_blocks=128)))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, backend) over the tiny chat model; blocks are conserved afterwards."""
    from fastapi.testclient import TestClient
    from router.http.app import create_app
    engine = _engine(_folder(tmp_path_factory, None))
    backend = ColocatedBackend(engine)
    yield TestClient(create_app(backend, RouterConfig(max_grammar_chars=4096))), engine
    backend.close()
    engine.check_integrity()


@pytest.fixture(scope="module")
def served_tools(tmp_path_factory):
    """The same model with a chat template that renders tools."""
    from fastapi.testclient import TestClient
    from router.http.app import create_app
    engine = _engine(_folder(tmp_path_factory, TOOL_TEMPLATE))
    backend = ColocatedBackend(engine)
    yield TestClient(create_app(backend)), engine
    backend.close()
    engine.check_integrity()


def _folder(factory, template):
    path = factory.mktemp("tiny-chat")
    tiny_chat_model_folder(path)
    if template is not None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 200, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client, url: str, **body) -> list[dict]:
    with client.stream("POST", url, json={"max_tokens": 200, "stream": True, **body}) as r:
        assert r.status_code == 200
        events = r.read().decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_json_schema_json_object_choice_and_regex_answers_validate(served):
    """response_format json_schema (n = 3, sampled) and json_object, streamed or not, and vLLM's
    guided_choice / guided_regex / structured_outputs on completions: every answer that ends
    follows (json_schema here is bounded, so every one ends)."""
    client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    whole = _chat(client, response_format=fmt, n=3, temperature=1.0, seed=1)
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "stop"
        validate(json.loads(choice["message"]["content"]), SCHEMA)
    chunks = _stream(client, "/v1/chat/completions", messages=ASK, response_format=fmt, temperature=1.0, seed=2)
    validate(json.loads("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)), SCHEMA)
    objects = _chat(client, response_format={"type": "json_object"}, n=8, temperature=1.0, seed=0)["choices"]
    ended = [c for c in objects if c["finish_reason"] == "stop"]    # a random model may ramble past max_tokens
    assert ended and all(isinstance(json.loads(c["message"]["content"]), dict) for c in ended)
    assert all(c["message"]["content"].startswith("{") for c in objects)
    asks = [({"guided_choice": ["sunny", "rain"]}, lambda t: t in ("sunny", "rain")),
            ({"guided_regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
            ({"structured_outputs": {"json": SCHEMA}}, lambda t: validate(json.loads(t), SCHEMA) or True)]
    for ask, ok in asks:
        r = client.post("/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 200,
                                                 "temperature": 1.0, "seed": 3, **ask})
        assert r.status_code == 200, r.text
        assert all(ok(c["text"]) and c["finish_reason"] == "stop" for c in r.json()["choices"])


def test_what_cannot_be_honoured_is_a_400(served):
    """A grammar that does not parse, one over --max-grammar-chars or --max-grammar-depth (a
    schema 1,000 deep, 25 kB, held the event loop for a minute in xgrammar), two asks at once, a tool
    choice naming no given tool, "auto" tools with a template that cannot show them, logprobs
    with tools, a whitespace pattern, and a grammar that allows no token: each a 400 naming the cause."""
    client, engine = served
    cases = [
        ({"guided_regex": "[a-"}, "invalid regex"),
        ({"guided_grammar": "root ::= x"}, "invalid grammar"),
        ({"guided_grammar": 'root ::= root "a"'}, "allows no token"),    # an empty language: no abort, a 400
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "invalid json_schema"),
        ({"guided_regex": "a" * 5000}, "--max-grammar-chars"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested_items(65)}}},
         "--max-grammar-depth"),
        ({"guided_json": "[" * 3000 + "]" * 3000}, "nests 3000 deep"),     # json.loads: RecursionError, a 500
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "give one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "renders tools"),
        ({"tools": [WEATHER]}, "renders tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "logprobs": True}, "logprobs"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ]
    for body, message in cases:
        r = client.post("/v1/chat/completions", json={"messages": ASK, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    assert not engine.has_unfinished_requests()


def test_a_grammar_is_parsed_off_the_event_loop(served, monkeypatch):
    """The grammar library parses a request's grammar on a worker thread, never on the event loop
    (a grammar of --max-grammar-chars held every other request while it parsed there); one that
    does not parse is still a 400 in OpenAI's shape, naming its parameter."""
    import asyncio
    import engine.grammar
    real, on_loop = engine.grammar.parse_grammar, []

    def parse(spec):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(spec)
    monkeypatch.setattr(engine.grammar, "parse_grammar", parse)
    client, _ = served
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 20, "guided_regex": "[ab]{2}"})
    bad = client.post("/v1/chat/completions", json={"messages": ASK, "guided_regex": "[a-"})
    assert ok.status_code == 200 and re.fullmatch("[ab]{2}", ok.json()["choices"][0]["text"]), ok.text
    error = bad.json()["error"]
    assert bad.status_code == 400 and "invalid regex" in error["message"] and error["param"] == "response_format"
    assert error["type"] == "invalid_request_error"
    assert on_loop == [False, False]


def _nested_items(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_named_and_required_tool_calls_whole_and_streamed(served):
    """A named function: one call whose arguments validate against its parameters; "required"
    over two tools: a call of either tool with valid arguments; streamed, the
    choice's last delta carries the same calls; finish_reason "tool_calls"."""
    client, _ = served
    named = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = _chat(client, **named, temperature=1.0, seed=4)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    validate(json.loads(call["function"]["arguments"]), SCHEMA)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):       # one call each (a random model would list calls past max_tokens)
        (c,) = _chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                     temperature=1.0, seed=seed)["choices"][0]["message"]["tool_calls"]
        validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
    chunks = _stream(client, "/v1/chat/completions", messages=ASK, **named, temperature=1.0, seed=5)
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (delta,) = last["delta"]["tool_calls"]
    assert delta["index"] == 0 and delta["function"]["name"] == "get_weather"
    validate(json.loads(delta["function"]["arguments"]), SCHEMA)
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks[:-1])


def test_auto_tools_render_in_the_prompt_and_hermes_calls_are_parsed(served_tools):
    """With a template that renders tools, "auto" shows them to the model (a longer prompt), and
    a Hermes-style <tool_call> block in the output (forced here by a regex) becomes a call; text
    around it stays content."""
    client, _ = served_tools
    small = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}   # 256-token context
    plain = _chat(client, max_tokens=1)["usage"]["prompt_tokens"]
    regex = r'ok <tool_call>\{"name": "f", "arguments": \{"d": [1-9]\}\}</tool_call>'
    choice = _chat(client, tools=[small], tool_choice="auto", guided_regex=regex, max_tokens=100)
    assert choice["usage"]["prompt_tokens"] > plain + 10
    message = choice["choices"][0]["message"]
    assert choice["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "ok"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "f" and re.fullmatch(r'\{"d": [1-9]\}', call["function"]["arguments"])
    free = _chat(client, tools=[small], max_tokens=5, temperature=0.0)["choices"][0]
    assert "tool_calls" not in free["message"] and free["finish_reason"] == "length"


def test_the_openai_client_reads_tool_calls_and_parsed_json(served):
    """The official client: tool calls (whole and streamed) and a json_schema answer parse."""
    openai = pytest.importorskip("openai")
    client, engine = served
    api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client)
    model = engine.model_name
    tools = [WEATHER]
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = api.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=named, max_tokens=200,
                                       temperature=1.0, seed=6)
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), SCHEMA)
    stream = api.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=named, max_tokens=200,
                                         temperature=1.0, seed=6, stream=True)
    deltas = [d for chunk in stream for d in (chunk.choices[0].delta.tool_calls or [])]
    assert [d.function.arguments for d in deltas] == [call.function.arguments]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    answer = api.chat.completions.create(model=model, messages=ASK, response_format=fmt, max_tokens=200)
    validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_the_router_moves_a_constrained_request_with_its_grammar():
    """D dies after 3 tokens: the router's new attempt has both nodes compile the same grammar
    spec again (as data, through the wire) before D reserves, and its DecodeRequest and
    PrefillRequest carry it with the 3 tokens as prior outputs, from which the nodes rebuild the
    matcher (tests/nodes/test_structured_disagg.py)."""
    from pdwire.control import AbortRequest, CompileGrammar, DecodeRequest, FirstToken, GrammarReady, PrefillRequest
    from pdwire.control import TokenDelta
    from pdwire.structured_output import StructuredOutput
    from pdwire.messages import Reserved
    from tests.disagg_harness import LOSSY, PROMPT, Cluster, first_of, run

    spec = StructuredOutput.json_schema(SCHEMA)

    async def test():
        async with Cluster(LOSSY) as c:
            p = await c.node("prefill-0", "prefill")
            ds = [await c.node("decode-0", "decode"), await c.node("decode-1", "decode")]
            out = c.generate(max_tokens=8, structured=spec)
            dead, compile_ = await first_of(ds, CompileGrammar)
            assert compile_.params.structured == spec == (await p.expect(CompileGrammar)).params.structured
            dead.send(GrammarReady("r1"))
            p.send(GrammarReady("r1"))
            assert (await dead.expect(DecodeRequest)).params.structured == spec
            dead.send(Reserved("r1", "x1", (3, 4), 0))
            assert (await p.expect(PrefillRequest)).params.structured == spec
            p.send(FirstToken("r1", 11, "a", None, ""))
            dead.send(TokenDelta("r1", 0, (11, 12, 13), 0, "abc", None, ""))
            while sum(len(o.token_ids) for o in (await out.next()).outputs) < 3:
                pass
            dead.die()
            live = ds[1 - ds.index(dead)]
            again = await live.expect(CompileGrammar, timeout=5.0)
            assert (await p.expect(AbortRequest)).rid == "r1"
            assert again.params.structured == spec and (await p.expect(CompileGrammar)).rid == again.rid
            live.send(GrammarReady(again.rid))
            p.send(GrammarReady(again.rid))
            req = await live.expect(DecodeRequest)
            assert (list(req.prompt_ids), req.prior_outputs, req.params.structured) == (PROMPT + [11, 12, 13], 3, spec)
            live.send(Reserved(req.rid, "x2", (7, 8), 0))
            pre = await p.expect(PrefillRequest)
            assert (pre.prior_outputs, pre.params.structured) == (3, spec)
    run(test)
