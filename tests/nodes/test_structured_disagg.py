"""Structured output split over a prefill and a decode node (real ZMQ): P samples the first token
under the grammar, D rebuilds the matcher from the spec, replays that token and continues; a
request moved with its prior outputs continues the same grammar. Every output validates."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from engine import SamplingParams
from engine.grammar_jobs import GrammarBusy, GrammarTimeout
from pdwire.control import CompileGrammar, PrefillRequest, RequestFailed
from pdwire.messages import Busy
from prefill_node.service import PrefillService
from pdwire.structured_output import GrammarKind, StructuredOutput
from tests.engine.test_structured_output import SCHEMA, SPECS, _check
from tests.node_harness import NodeHarness, Result
from tests.schema_check import validate
from tests.tiny_chat_model import tiny_chat_model_folder


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_chat_model_folder(path)
    return str(path)


@pytest.fixture(scope="module")
def shared_harness(chat_dir):
    """One pair of nodes for the tests at the end of this file (their compile worker processes,
    seconds each to start, started once). Those tests come last: the slow_harness tests run with
    no other nodes beside theirs."""
    # the tests compute colocated outputs while nothing answers the nodes' heartbeats: a first
    # structured request there starts compile worker processes (seconds on a loaded machine)
    h = NodeHarness(chat_dir, block_size=8, num_blocks=160, router_timeout_s=120)
    yield h
    h.idle()
    h.close()
    for service in (h.prefill, h.decode):
        service.engine.check_integrity()


@pytest.fixture
def harness(shared_harness):
    """The shared nodes; after each test both are idle, every block accounted for, none pinned."""
    yield shared_harness
    shared_harness.idle()
    for service in (shared_harness.prefill, shared_harness.decode):
        service.engine.check_integrity()
        assert not service.engine.block_manager.num_pins, "a shipped block stayed pinned"


def _tokens(result) -> list[int]:
    return [result.tokens[i] for i in sorted(result.tokens)]


@pytest.fixture
def slow_harness(chat_dir):
    h = NodeHarness(chat_dir, block_size=8, num_blocks=160, heartbeat_s=0.05, grammar_compile_timeout_s=120,
                    grammar_max_compiles=4)
    yield h
    h.idle()
    h.close()
    for service in (h.prefill, h.decode):
        service.engine.check_integrity()


def test_grammars_compiling_do_not_hold_a_nodes_loop(slow_harness, held):
    """Three grammars compiling (of four threads) hold no node's loop: while they compile,
    both nodes keep heartbeating, and a plain request and one with a grammar of its own run from
    start to end; once they compile,
    their parked requests are reserved, prefilled and decoded, each output following its grammar
    (the decode node used to reserve each within its loop, up to the compile time limit apiece)."""
    h = slow_harness
    prompt = h.decode.engine.encode("hello world")
    specs = [StructuredOutput(GrammarKind.REGEX, f"held-{i}[0-9]") for i in range(3)]
    for i, spec in enumerate(specs):
        h.submit(f"g{i}", prompt, SamplingParams(temperature=0.0, max_tokens=20, structured=spec))
    beats = dict(h.beats)
    h.submit("plain", prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=5, ignore_eos=True))
    h.submit("free", prompt, SamplingParams(temperature=0.0, max_tokens=20, structured=SPECS[1]))
    plain, free = h.wait(["plain", "free"])
    h.pump(lambda: all(h.beats[n] >= beats[n] + 5 for n in beats))
    assert plain.failed is None and len(plain.tokens) == 5
    assert free.failed is None and free.finish == "stop"     # a grammar of its own compiles beside them
    assert all(h.results[f"g{i}"].reserved is None and h.results[f"g{i}"].failed is None for i in range(3))
    held.set()
    for spec, r in zip(specs, h.wait([f"g{i}" for i in range(3)])):
        assert r.failed is None and r.finish == "stop"
        _check(h.decode.engine.tokenizer.decode(_tokens(r), skip_special_tokens=True), spec)


def test_both_nodes_answer_compile_grammar_once_their_compile_is_done(slow_harness, held):
    """CompileGrammar (the router's, to both nodes at once) parks on each node while the grammar
    compiles: no answer, nothing reserved, both loops heartbeating; then each answers GrammarReady,
    and the DecodeRequest that follows is reserved and served at once. A grammar that does not
    compile is each node's RequestFailed, not retryable (a 400)."""
    h = slow_harness
    prompt = h.decode.engine.encode("hello world")
    params = SamplingParams(temperature=0.0, max_tokens=20, structured=StructuredOutput(GrammarKind.REGEX, "held-[0-9]"))
    bad = SamplingParams(structured=StructuredOutput(GrammarKind.REGEX, "[a-"))
    h.results["c"], h.results["bad"] = Result(), Result()
    for node in ("prefill-0", "decode-0"):
        h.send(node, CompileGrammar("c", params))
        h.send(node, CompileGrammar("bad", bad))
    beats = dict(h.beats)
    h.pump(lambda: all(h.beats[n] >= beats[n] + 3 for n in beats) and len(h.results["bad"].failures) == 2)
    assert all(not f.retryable and "invalid regex" in f.reason for _, f in h.results["bad"].failures)
    assert h.results["c"].compiled == [] and h.results["c"].failed is None
    assert h.decode.engine.block_manager.num_free_blocks == h.decode.engine.block_manager.num_blocks
    held.set()
    h.pump(lambda: sorted(h.results["c"].compiled) == ["decode-0", "prefill-0"])
    h.submit("c", prompt, params)
    r = h.wait(["c"])[0]
    assert r.failed is None and r.finish == "stop"
    _check(h.decode.engine.tokenizer.decode(_tokens(r), skip_special_tokens=True), params.structured)


def test_a_prefill_nodes_busy_grammar_compiler_answers_busy():
    """GrammarBusy on a prefill node is a Busy (the router asks another prefill node, or this one
    after its retry hint, and answers a 503 past its admission timeout), not a retryable
    RequestFailed (the router retried it, each time taking a decode reservation, then a 500); a
    grammar that cannot compile stays a non-retryable failure (a 400); one past this node's time
    limit, which its decode node compiled in time, is this node's load: a Busy, not a 400."""
    service, sent = PrefillService.__new__(PrefillService), []
    service.link = SimpleNamespace(send=sent.append)
    service._refuse("r1", GrammarBusy("too many compiles"))
    service._refuse("r2", ValueError("invalid regex"))
    service._refuse("r3", GrammarTimeout("it did not compile within 5.0 s"))
    assert isinstance(sent[0], Busy) and (sent[0].rid, sent[0].reason) == ("r1", "too many compiles")
    assert sent[1] == RequestFailed("r2", "invalid regex", False)
    assert isinstance(sent[2], Busy) and sent[2].rid == "r3"    # the decode node compiled it in time


def test_disaggregated_outputs_follow_their_grammar_and_match_colocated(harness, chat_dir, make_llm):
    """Schema, regex, choice and EBNF requests (greedy and seeded), in flight with free ones: each
    output validates, ends "stop", and is token for token the colocated engine's."""
    llm = make_llm(chat_dir, block_size=8, num_blocks=160)
    prompt = llm.engine.encode("hello world")
    params = [SamplingParams(temperature=0.0 if i < 4 else 1.0, seed=i, max_tokens=200, structured=SPECS[i % 4])
              for i in range(8)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True))
    colocated = [o.outputs[0] for o in llm.generate([prompt] * len(params), params)]
    for i, p in enumerate(params):
        harness.submit(f"r{i}", prompt, p)
    results = harness.wait([f"r{i}" for i in range(len(params))])
    for p, r, c in zip(params, results, colocated):
        assert r.failed is None and _tokens(r) == c.token_ids
        if p.structured is not None:
            assert r.finish == "stop"
            _check(llm.engine.tokenizer.decode(_tokens(r), skip_special_tokens=True), p.structured)


def test_a_moved_request_continues_its_grammar_on_both_nodes(harness, chat_dir, make_llm):
    """Moved after k tokens (prompt + those tokens, prior_outputs = k), a seeded constrained
    request gives the colocated run's remaining tokens, and prior + new validates; prior outputs
    that break the grammar fail the request (not retryable) and leak nothing."""
    llm = make_llm(chat_dir, block_size=8, num_blocks=160)
    tok = llm.engine.tokenizer
    prompt = llm.engine.encode("hello world")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=200, structured=StructuredOutput.json_schema(SCHEMA))
    whole = llm.generate([prompt], params)[0].outputs[0].token_ids
    cuts = (1, len(whole) // 2)
    for k in cuts:
        harness.submit(f"m{k}", prompt + whole[:k], dataclasses.replace(params, max_tokens=200 - k), prior_outputs=k)
    bad = tok.encode("]]", add_special_tokens=False)
    harness.submit("bad", prompt + bad, params, prior_outputs=len(bad))
    *moved, failed = harness.wait([f"m{k}" for k in cuts] + ["bad"])
    for k, m in zip(cuts, moved):
        assert m.failed is None and m.finish == "stop" and _tokens(m) == whole[k:]
        validate(json.loads(tok.decode(whole[:k] + _tokens(m), skip_special_tokens=True)), SCHEMA)
    assert failed.failed is not None and not failed.failed.retryable and "does not follow" in failed.failed.reason



EMPTY = StructuredOutput(GrammarKind.GRAMMAR, 'root ::= root "a"')      # its language is empty


def test_an_empty_language_grammar_is_refused_on_both_nodes_and_leaks_nothing(harness):
    """A grammar whose first step allows no token is refused at admission, not retryable (the
    router's 400), by the decode node's reservation and by the prefill node's add_request, whose
    transfer is aborted: no shipment stays open, neither node stays busy (it used to end in an
    abort with no token that the prefill node told no one about, its shipment open, its loop
    spinning, D's reservation held until its lease)."""
    prompt = harness.decode.engine.encode("hello world")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured=EMPTY)
    harness.submit("dead", prompt, params)
    harness.results["direct"] = Result()
    harness.send("prefill-0", PrefillRequest("direct", tuple(prompt), params, harness.hellos["decode-0"].kv_endpoint,
                                             "ab" * 16, (0, 1), 0))
    for r in harness.wait(["dead", "direct"]):
        assert not r.failed.retryable and "allows no token" in r.failed.reason and r.first is None
    assert harness.results["dead"].failures[0][0] == "decode-0" and harness.results["direct"].failures[0][0] == "prefill-0"
    harness.idle()
    assert not harness.prefill.shipper.shipments and not harness.decode.xfer_rid
