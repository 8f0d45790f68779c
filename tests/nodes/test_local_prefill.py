"""A decode node that prefills a prompt itself (DecodeRequest.local_prefill): chunked beside its
running decodes, from the blocks its prefix cache holds; greedy output equals transformers', a
seeded draw equals the shipped path's, nothing is shipped, aborts leak nothing; and the nodes'
KV events leave the router's view of each prefix cache exactly as the cache is."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from pdwire.control import AbortRequest
from tests.model_factory import hf_greedy
from tests.node_harness import serving, tokens as _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def harness(model_dir):
    # a 16-token step budget: a prompt of 40 tokens is prefilled in 3 chunks beside the decodes
    with serving(model_dir[0], block_size=8, num_blocks=64, max_num_batched_tokens=16) as h:
        yield h


def test_local_prefill_beside_decodes_equals_transformers_and_ships_nothing(harness, model_dir):
    """A prompt sharing 4 cached blocks with an earlier one is prefilled on the decode node in
    chunks while another request decodes there: both decode what transformers decodes, the first
    token comes from the decode node (index 0), and no block of the local prompt is shipped."""
    _, hf = model_dir
    shared = [(i * 13) % 400 + 5 for i in range(32)]
    harness.submit("a", shared + [1, 2, 3], GREEDY)
    harness.wait(["a"])
    harness.idle()
    written = harness.decode.receiver.metrics.blocks_written
    running = [(i * 7) % 300 + 9 for i in range(20)]
    harness.submit("c", running, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    harness.pump(lambda: len(harness.results["c"].tokens) > 2)      # c is decoding on D
    local = shared + [(i * 31) % 200 + 11 for i in range(40)]
    harness.submit("b", local, GREEDY, local=True)
    b, c = harness.wait(["b", "c"])
    assert b.failed is None and b.first is None and b.reserved.cached_prefix_blocks == 4
    assert b.reserved.taken_blocks == 9             # a's 4 cached blocks were used by no request: taken
    assert _tokens(b) == hf_greedy(hf, local, 12)
    assert _tokens(c) == hf_greedy(hf, running, 40)
    assert harness.decode.receiver.metrics.blocks_written - written == -(-len(running) // 8)   # c's only


def test_local_prefill_draws_the_seeded_tokens_the_shipped_path_draws(harness):
    """A seeded, sampled request (and its continuation after a move, prior_outputs > 0) gives the
    same tokens prefilled on the decode node as prefilled on the prefill node."""
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True,
                            presence_penalty=0.5)
    prompt = [(i * 19) % 450 + 4 for i in range(29)]
    harness.submit("remote", prompt, params)
    harness.submit("moved", prompt + [7, 8], params, prior_outputs=2)
    remote, moved = harness.wait(["remote", "moved"])
    harness.submit("here", prompt, params, local=True)
    harness.submit("moved-here", prompt + [7, 8], params, prior_outputs=2, local=True)
    here, moved_here = harness.wait(["here", "moved-here"])
    assert _tokens(here) == _tokens(remote) and here.text == remote.text
    assert _tokens(moved_here) == _tokens(moved)


def test_aborting_a_local_prefill_mid_prompt_frees_its_blocks(harness):
    """An AbortRequest while the decode node is still prefilling the prompt frees every block
    (the fixture checks integrity); a request after it is served."""
    long = [(i * 23) % 480 + 2 for i in range(120)]
    harness.submit("gone", long, SamplingParams(max_tokens=50, ignore_eos=True), local=True)
    harness.pump(lambda: harness.results["gone"].reserved is not None)
    harness.send("decode-0", AbortRequest("gone"))
    harness.pump(lambda: not harness.decode.engine.has_unfinished_requests(), 30.0)
    assert not harness.results["gone"].tokens
    harness.submit("next", [5, 6, 7], GREEDY, local=True)
    (nxt,) = harness.wait(["next"])
    assert nxt.failed is None and len(nxt.tokens) == 12


def test_kv_events_leave_the_routers_view_equal_to_each_prefix_cache(harness):
    """After prompts are cached, shipped, adopted and some evicted, what each node's KV events
    say it holds is exactly the hashes its block manager holds."""
    for i in range(12):     # 10 x 7 cached blocks through P's 64, 12 x 9 through D's: evictions on both
        harness.submit(f"r{i}", [(i * 101 + j * 7) % 500 + 1 for j in range(60)], GREEDY, local=i in (1, 5))
        harness.wait([f"r{i}"])
    harness.idle()
    for node, service in (("prefill-0", harness.prefill), ("decode-0", harness.decode)):
        held = set(service.engine.block_manager.cached_hashes())
        harness.pump(lambda: harness.cached[node] == held, 10.0)
        assert held and harness.evicted[node] > 0
