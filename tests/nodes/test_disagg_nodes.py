"""Prefill and decode node services over real ZMQ: KV blocks shipped block by block, adopted,
decoded — token for token what transformers produces; nothing leaks."""
from __future__ import annotations

import dataclasses

import pytest
import zmq

from decode_node.streamer import Streamer
from engine import SamplingParams
from pdwire.outputs import CompletionOutput, RequestOutput
from pdwire.control import AbortRequest
from tests.model_factory import hf_greedy
from tests.node_harness import NodeHarness, serving, tokens as _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def harness(model_dir):
    with serving(model_dir[0], block_size=8, num_blocks=48) as h:
        yield h


def test_disaggregated_greedy_matches_transformers(harness, model_dir):
    """Prompts shorter than, equal to and spanning several blocks, in flight together, decode
    on D exactly what transformers decodes; P's first token is the first of them."""
    _, hf = model_dir
    prompts = [[1, 17, 99, 4, 250], list(range(10, 18)), [(i * 37) % 500 + 3 for i in range(45)]]
    for i, p in enumerate(prompts):
        harness.submit(f"r{i}", p, GREEDY)
    results = harness.wait([f"r{i}" for i in range(3)])
    for p, r in zip(prompts, results):
        assert r.failed is None and r.finish == "length"
        assert _tokens(r) == hf_greedy(hf, p, 12)
        assert r.first.token_id == _tokens(r)[0]
    sent = harness.decode.receiver.metrics.blocks_written
    assert sent == sum(-(-len(p) // 8) for p in prompts)       # every prompt block, once


def test_decode_prefix_cache_skips_shipping_cached_blocks(harness, model_dir):
    """A second prompt sharing 3 full blocks with one D has cached ships only its new blocks,
    and still decodes what transformers decodes."""
    _, hf = model_dir
    shared = [(i * 13) % 400 + 5 for i in range(24)]
    harness.submit("a", shared + [1, 2, 3], GREEDY)
    harness.wait(["a"])
    harness.idle()
    before = harness.decode.receiver.metrics.blocks_written
    harness.submit("b", shared + [7, 8, 9, 10], GREEDY)
    (b,) = harness.wait(["b"])
    assert (b.reserved.cached_prefix_blocks, b.reserved.taken_blocks) == (3, 4)     # a's 3 were unused: taken
    assert harness.decode.receiver.metrics.blocks_written - before == 1
    assert _tokens(b) == hf_greedy(hf, shared + [7, 8, 9, 10], 12)


def test_bad_request_fails_cleanly_and_others_complete(harness):
    """A prompt longer than the context gets a non-retryable RequestFailed; a good request
    in flight at the same time completes."""
    harness.submit("good", [5, 6, 7], GREEDY)
    harness.submit("bad", [7] * 600, GREEDY)
    good, bad = harness.wait(["good", "bad"])
    assert bad.failed is not None and not bad.failed.retryable and "context" in bad.failed.reason
    assert good.failed is None and len(good.tokens) == 12


def test_busy_when_decode_pool_cannot_hold_the_request(harness):
    """A request whose prompt plus growth exceeds D's free blocks is answered Busy, not
    prefilled in vain."""
    harness.submit("huge", list(range(3, 300)), SamplingParams(max_tokens=200, ignore_eos=True))
    (huge,) = harness.wait(["huge"])
    assert huge.failed is not None and huge.failed.reason == "busy"
    assert harness.prefill.engine.metrics().num_waiting == 0


def test_abort_mid_decode_frees_blocks_on_both_nodes(harness):
    """AbortRequest during decode frees the request's blocks on D; P keeps only cache."""
    harness.submit("long", [3, 4, 5], SamplingParams(max_tokens=300, ignore_eos=True))
    harness.pump(lambda: len(harness.results["long"].tokens) >= 3)
    harness.send("decode-0", AbortRequest("long"))
    harness.send("prefill-0", AbortRequest("long"))
    harness.pump(lambda: not harness.decode.engine.has_unfinished_requests())
    harness.idle()
    assert harness.decode.engine.block_manager.num_free_blocks == 48


def test_garbage_control_frames_are_dropped_and_the_node_keeps_serving(harness):
    """Malformed or unsealed frames on the router's connection are dropped and counted; the next
    request completes."""
    for junk in (b"", b"\xc1", b"\x93\x01\xaadecode_req\x90", bytes(range(200))):
        for node in ("decode-0", "prefill-0"):
            harness.sock.send_multipart([harness.end.peers[node], junk, b"t" * 40])
    harness.submit("after", [9, 9, 9], GREEDY)
    (after,) = harness.wait(["after"])
    assert after.failed is None and len(after.tokens) == 12
    assert harness.decode.link.dropped == 4 and harness.prefill.link.dropped == 4


def test_prompt_logprobs_come_with_the_first_token(harness, model_dir, make_llm):
    """prompt_logprobs: the prefill node scores the prompt and sends the scores with the first
    token; they equal the colocated engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    prompt = [(i * 37) % 500 + 3 for i in range(21)]
    colocated = make_llm(model_dir[0], block_size=8, num_blocks=48).generate([prompt], params)[0]
    harness.submit("p", prompt, params)
    (p,) = harness.wait(["p"])
    assert p.failed is None and p.first.prompt_logprobs[0] is None
    wire = [dict(map(tuple, e)) for e in p.first.prompt_logprobs[1:]]
    for got, want in zip(wire, colocated.prompt_logprobs[1:]):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-5 for t in got)


def test_a_first_token_too_big_to_send_fails_its_request_and_the_node_serves_on(harness, monkeypatch):
    """Prompt scores that would not fit one control message fail their request (not retryable:
    they would not fit anywhere) instead of being dropped by the router, and the node serves on."""
    monkeypatch.setattr(harness.prefill.link._framer, "max_header_bytes", 2000)
    harness.submit("big", list(range(3, 60)), SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5))
    # the decode node may report its reservation's end first (the prefill node ended the transfer)
    big = harness.results["big"]
    harness.pump(lambda: any(node == "prefill-0" for node, _ in big.failures))
    failed = next(msg for node, msg in big.failures if node == "prefill-0")
    assert not failed.retryable and "first token" in failed.reason
    monkeypatch.undo()
    harness.submit("ok", [5, 6, 7], GREEDY)
    (ok,) = harness.wait(["ok"])
    assert ok.failed is None and len(ok.tokens) == 12


def test_min_tokens_run_disaggregated(harness, model_dir):
    """min_tokens > 1 reaches both nodes (the prefill node samples only the first token, EOS
    banned) and the request decodes transformers' tokens; the prefill node stays up."""
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, ignore_eos=True)
    harness.submit("m", [5, 6, 7], params)
    (m,) = harness.wait(["m"])
    assert m.failed is None and _tokens(m) == hf_greedy(model_dir[1], [5, 6, 7], 8)
    assert all(t.is_alive() for t in harness.threads)


def test_a_failed_engine_step_fails_its_requests_retryably_and_the_node_serves_on(harness, model_dir):
    """The decode node's engine raises in one step: the request it held fails with a retryable
    RequestFailed (the router runs it elsewhere), nothing leaks, and the next request decodes
    transformers' tokens on the same node."""
    runner = harness.decode.engine.runner
    execute, calls = runner.execute, []

    def breaks_once(scheduled):
        calls.append(len(calls))
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return execute(scheduled)
    runner.execute = breaks_once
    harness.submit("hit", [1, 17, 99, 4, 250], GREEDY)
    (hit,) = harness.wait(["hit"])
    assert hit.failed is not None and hit.failed.retryable and "device lost" in hit.failed.reason
    harness.submit("after", [5, 6, 7], GREEDY)
    (after,) = harness.wait(["after"])
    assert after.failed is None and _tokens(after) == hf_greedy(model_dir[1], [5, 6, 7], 12)


def test_streamer_reports_text_a_stop_string_cut_after_it_was_sent():
    """The engine's text shrinks when a stop string completes over text already sent: the last
    delta carries the new end (offset = its length, no text) and the stop."""
    streamer = Streamer()
    streamer.open("r")
    out = lambda ids, text, finish=None: RequestOutput("r", [1], [CompletionOutput(0, text, ids, None, finish)],
                                                        finish is not None)
    first = streamer.delta(out([5, 6], "so he"))
    last = streamer.delta(out([5, 6, 7], "so ", "stop"))
    assert (first.index, first.token_ids, first.text_offset, first.text) == (0, (5, 6), 0, "so he")
    assert (last.index, last.token_ids, last.text_offset, last.text, last.finish_reason) == (2, (7,), 3, "", "stop")
    assert "r" not in streamer.streams


def test_seeded_request_samples_as_colocated_and_after_a_move(harness, model_dir, make_llm):
    """A seeded, sampled request with penalties gives the colocated engine's tokens, although P
    samples the first and D the rest; continued elsewhere from its first 4 tokens (a moved
    request: prior_outputs=4), it gives the same remaining tokens."""
    params = SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=10, ignore_eos=True, logprobs=2,
                            presence_penalty=1.5, frequency_penalty=1.0)
    prompt = [11, 12, 13, 40, 41]
    colocated = make_llm(model_dir[0], block_size=8, num_blocks=48).generate([prompt], params)[0].outputs[0]
    harness.submit("s", prompt, params)
    (s,) = harness.wait(["s"])
    assert s.failed is None and _tokens(s) == colocated.token_ids
    assert s.first.logprobs is not None and s.first.token_id in [p[0] for p in s.first.logprobs]
    moved = dataclasses.replace(params, max_tokens=6)
    harness.submit("m", prompt + colocated.token_ids[:4], moved, prior_outputs=4)
    harness.submit("fresh", prompt + colocated.token_ids[:4], moved)
    m, fresh = harness.wait(["m", "fresh"])
    assert m.failed is None and _tokens(m) == colocated.token_ids[4:]
    assert _tokens(fresh) != colocated.token_ids[4:]        # without the count it samples anew
    assert zmq.zmq_version_info() >= (4, 0)


def test_a_node_that_leaked_a_block_says_so_when_it_closes(model_dir):
    """Block conservation is checked as a node closes: a leaked block makes run() report it (and
    `pdserve decode` exit 70), an intact pool reports True."""
    h = NodeHarness(model_dir[0], block_size=8, num_blocks=32)
    leaked = h.decode.engine.block_manager.blocks[0]
    leaked.ref_count += 1                       # held by no sequence: what a leak looks like
    with pytest.raises(AssertionError, match="decode-0': False"):
        h.close()
    assert h.intact == {"prefill-0": True, "decode-0": False}
    leaked.ref_count -= 1
