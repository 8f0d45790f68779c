"""Structured output in the engine: every output follows its grammar, batched beside
unconstrained rows; a request continued from prior outputs (a move) stays valid; the grammar's
spec crosses the wire as data."""
from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammar import GrammarCompiler
from engine.sampler import Sampler, SamplingRow
from pdwire.control import params_from_wire, params_to_wire
from pdwire.structured_output import GrammarKind, StructuredOutput
from tests.schema_check import validate
from tests.tiny_chat_model import tiny_chat_model_folder

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "n", "color", "ok", "tags"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]{1,3}"
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [xyz] | "no"'


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_chat_model_folder(path)
    return str(path)


@pytest.fixture(scope="module")
def shared_llm(chat_dir):
    """One small engine (32 blocks) for the tests that admit requests to it or only need its
    tokenizer: its grammar compile worker process (seconds to start) starts once, not per test."""
    llm = LLM(chat_dir, block_size=16, num_blocks=32)
    yield llm
    llm.close()


@pytest.fixture
def small_engine(shared_llm):
    """The shared engine; after the test no request is left and every block is accounted for."""
    yield shared_llm.engine
    shared_llm.engine.check_integrity()
    assert not shared_llm.engine.has_unfinished_requests(), "a request was left"


@pytest.fixture(scope="module")
def compiler(shared_llm):
    """A grammar compiler of the tiny chat tokenizer (EOS: 2) for the tests that sample rows
    themselves; its worker process starts once."""
    engine = shared_llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, [2])
    yield compiler
    compiler.close()


def _run(engine, rid: str, prompt: list[int], params: SamplingParams, prior_outputs: int):
    """A request stepped to its end; its final output."""
    engine.add_request(rid, prompt, params, prior_outputs)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid), final)
    return final.outputs[0]


def _check(text: str, spec: StructuredOutput) -> None:
    if spec.kind is GrammarKind.JSON_SCHEMA:
        validate(json.loads(text), json.loads(spec.spec))
    elif spec.kind is GrammarKind.JSON_OBJECT:
        assert isinstance(json.loads(text), dict)
    elif spec.kind is GrammarKind.REGEX:
        assert re.fullmatch(spec.spec, text), text
    elif spec.kind is GrammarKind.CHOICE:
        assert text in json.loads(spec.spec)
    else:
        assert re.fullmatch(r"\((?:[xyz]|no)(?:,(?:[xyz]|no))*\)", text), text


SPECS = [StructuredOutput.json_schema(SCHEMA), StructuredOutput(GrammarKind.REGEX, REGEX),
         StructuredOutput.choice(["yes", "no, sir", "a.b*"]), StructuredOutput(GrammarKind.GRAMMAR, GRAMMAR)]


def test_every_output_follows_its_grammar_batched_with_free_rows(chat_dir, make_llm):
    """32 requests in one batch, half constrained (schema, regex, choice, EBNF; greedy, seeded and
    n = 2), half free: each constrained output parses and validates, ends "stop" when its grammar
    ends; the free rows are what they are alone."""
    llm = make_llm(chat_dir, block_size=16, num_blocks=256, max_num_seqs=48)
    params = []
    for i in range(16):
        spec = SPECS[i % 4]
        params.append(SamplingParams(temperature=0.0 if i < 4 else 1.0, seed=i, max_tokens=300, structured=spec,
                                     n=2 if i % 5 == 0 else 1))
        params.append(SamplingParams(temperature=0.0 if i < 4 else 1.0, seed=i, max_tokens=8, ignore_eos=True))
    outs = llm.generate(["hello world"] * 32, params)
    for p, out in zip(params, outs):
        for c in out.outputs:
            if p.structured is not None:
                assert c.finish_reason == "stop", c.text
                _check(c.text, p.structured)
    alone = llm.generate(["hello world"], params[1])[0].outputs[0]
    assert alone.token_ids == outs[1].outputs[0].token_ids


def test_a_moved_request_continues_its_grammar(chat_dir, make_llm):
    """Continued on another engine from its first k tokens (prior_outputs = k), a seeded
    constrained request gives the same remaining tokens, and the whole output validates; prior
    outputs that break the grammar are refused before any work."""
    spec = StructuredOutput.json_schema(SCHEMA)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=300, structured=spec)
    first = make_llm(chat_dir, block_size=16, num_blocks=128)
    prompt = first.engine.encode("hello world")
    whole = first.generate([prompt], params)[0].outputs[0]
    validate(json.loads(whole.text), SCHEMA)
    other = make_llm(chat_dir, block_size=16, num_blocks=128)
    for k in (1, 5, len(whole.token_ids) // 2):
        moved = _run(other.engine, f"m{k}", prompt + whole.token_ids[:k], params, k)
        assert moved.token_ids == whole.token_ids[k:] and moved.finish_reason == "stop"
    bad = other.engine.encode("}}")
    with pytest.raises(ValueError, match="does not follow"):
        other.engine.add_request("bad", prompt + bad, params, prior_outputs=len(bad))


def test_the_mask_touches_only_constrained_rows_and_allows_eos_only_when_complete(small_engine, compiler):
    """One bitmask for the batch: an unconstrained row's logits stay as they were; a grammar that
    is not complete forbids EOS even where EOS is the model's favourite; once complete, only EOS."""
    engine = small_engine
    spec = StructuredOutput.choice(["yes"])
    m = compiler.matcher(compiler.compiled(spec))
    logits = torch.randn(2, engine.model_config.vocab_size)
    logits[:, 2] = 100.0                                        # EOS first by far
    sampler = Sampler()
    sampler.grammars = compiler
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], None),
            SamplingRow(SamplingParams(temperature=0), [], [], None, grammar=m)]
    free, held = sampler(logits.clone(), rows)
    assert free.token_id == 2 and held.token_id != 2
    for t in engine.tokenizer.encode("yes", add_special_tokens=False):
        assert m.accept(t)
    allowed = logits.clone()
    compiler.mask(allowed, [None, m])
    assert torch.equal(allowed[0], logits[0])
    assert torch.isfinite(allowed[1]).nonzero().flatten().tolist() == [2]


def test_the_spec_travels_as_data_and_old_maps_still_decode():
    """SamplingParams cross the wire as a map: a structured output as [kind, spec]; a map without
    the field (an older peer) decodes to no structured output, and a request without one sends none."""
    params = SamplingParams(max_tokens=5, structured=StructuredOutput(GrammarKind.REGEX, "a+"))
    wire = params_to_wire(params)
    assert wire["structured"] == ["regex", "a+"]
    assert params_from_wire(wire) == params
    plain = params_to_wire(SamplingParams(max_tokens=5))
    assert "structured" not in plain and params_from_wire(plain).structured is None
    with pytest.raises(ValueError):
        params_from_wire({**plain, "structured": ["pickle", "x"]})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(GrammarKind.REGEX, "a+"))


def test_a_grammar_that_does_not_compile_is_refused_before_any_work(small_engine):
    """A bad regex, EBNF or schema is a ValueError at add_request; nothing is queued."""
    engine = small_engine
    for spec in (StructuredOutput(GrammarKind.REGEX, "[a-"), StructuredOutput(GrammarKind.GRAMMAR, "root ::= x"),
                 StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "nope"}')):
        with pytest.raises(ValueError, match=f"invalid {spec.kind.value}"):
            engine.add_request("r", [5, 6], SamplingParams(structured=spec))
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_allows_no_token_is_refused_at_admission(small_engine):
    """An empty-language grammar (any client can send one: `root ::= root "a"`, or a regex this
    vocabulary cannot spell) is a ValueError at add_request, nothing queued (it used to run to an
    abort with no token, which a prefill node passed on to no one); the engine serves on."""
    engine = small_engine
    with pytest.raises(ValueError, match="allows no token"):
        engine.add_request("dead", [5, 6], SamplingParams(
            temperature=1.0, structured=StructuredOutput(GrammarKind.GRAMMAR, 'root ::= root "a"')))
    assert not engine.has_unfinished_requests()
    out = _run(engine, "ok", [5, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True), 0)
    assert (out.finish_reason, len(out.token_ids)) == ("length", 4)


def test_the_grammar_wins_over_banned_ids(small_engine, compiler):
    """A row whose grammar allows only what min_tokens bans (a complete answer: only EOS) keeps
    those tokens, greedy and at random: the grammar wins (SamplingParams refuses min_tokens with a
    grammar; the sampler holds to it for any row). A row with allowed tokens left keeps its ban."""
    engine = small_engine
    done = compiler.matcher(compiler.compiled(StructuredOutput.choice(["yes"])))
    open_ = compiler.matcher(compiler.compiled(StructuredOutput.choice(["yes", "yes!"])))
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)
    assert all(done.accept(t) for t in yes) and all(open_.accept(t) for t in yes)
    sampler = Sampler()
    sampler.grammars = compiler
    rows = [SamplingRow(SamplingParams(temperature=t), [], [], 1, (2,), grammar=m)
            for t in (0.0, 1.0) for m in (done, open_)]
    logits = torch.randn(4, engine.model_config.vocab_size)
    logits[:, 2] = 100.0                                        # EOS first by far
    bang = engine.tokenizer.encode("!", add_special_tokens=False)
    assert [s.token_id for s in sampler(logits, rows)] == [2, bang[0], 2, bang[0]]


def test_a_spec_nested_past_the_wire_cap_is_a_value_error():
    """A JSON spec deeper than MAX_SPEC_DEPTH is refused before json.loads (RecursionError past
    ~1,000) and before xgrammar (time cubic in the depth), from the wire as from a caller."""
    from pdwire.structured_output import MAX_SPEC_DEPTH, json_depth
    assert json_depth('{"a": [1, {"b": "[[{"}], "c": "\\\\"}') == 3
    deep = "[" * (MAX_SPEC_DEPTH + 1) + "]" * (MAX_SPEC_DEPTH + 1)
    for kind in (GrammarKind.JSON_SCHEMA, GrammarKind.CHOICE):
        with pytest.raises(ValueError, match=f"nests {MAX_SPEC_DEPTH + 1} deep"):
            StructuredOutput.from_wire([kind.value, deep])
    assert StructuredOutput.json_schema({"type": "array", "items": {"type": "string"}}).spec
