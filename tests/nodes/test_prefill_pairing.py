"""A prefill node pairs with a decode node a step per tick (KVSender.try_connect): a decode
endpoint that never answers holds up only the requests for it; the node heartbeats and serves every
other request meanwhile, and those requests fail, retryably, once --kv-connect-timeout-s passes."""
from __future__ import annotations

import socket

import pytest

from engine import SamplingParams
from pdwire.control import AbortRequest, PrefillRequest
from tests.node_harness import Result, serving

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def silent():
    """A decode endpoint whose listener the kernel accepts connections for but nobody reads: a
    ZeroMQ peer there never gets past the greeting (a frozen or unreachable decode node)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _prefill_for(h, rid: str, endpoint: str) -> None:
    """The router's PrefillRequest for rid, naming endpoint as the decode node's receiver."""
    h.results[rid] = Result()
    h.send("prefill-0", PrefillRequest(rid, (5, 6, 7), GREEDY, endpoint, f"xfer-{rid}", (1,), 0))


def test_a_silent_decode_node_holds_up_only_its_own_requests(model_dir, silent):
    """While a PrefillRequest for a silent decode node waits for its pairing (timeout 60 s), the
    prefill node keeps heartbeating and serves a request for the live decode node to the end; the
    waiting request is aborted before its pairing times out, and nothing was heard of it."""
    with serving(model_dir[0], block_size=8, num_blocks=48, kv_connect_timeout_s=60.0) as h:
        _prefill_for(h, "stalled", silent)
        beats = h.beats["prefill-0"]
        h.submit("live", [3, 4, 5, 6], GREEDY)
        (live,) = h.wait(["live"])
        h.pump(lambda: h.beats["prefill-0"] >= beats + 3)
        assert live.failed is None and len(live.tokens) == 4
        assert h.results["stalled"] == Result()            # still waiting: no token, no failure
        h.send("prefill-0", AbortRequest("stalled"))
        h.pump(lambda: h.beats["prefill-0"] >= beats + 5)
        assert h.results["stalled"] == Result()


def test_requests_for_a_silent_decode_node_fail_retryably_at_the_timeout(model_dir, silent):
    """Two requests waiting for the same silent decode node both fail, retryably, once the
    pairing's timeout (1 s) passes; the node then serves a request for the live decode node."""
    with serving(model_dir[0], block_size=8, num_blocks=48, kv_connect_timeout_s=1.0) as h:
        _prefill_for(h, "s1", silent)
        _prefill_for(h, "s2", silent)
        s1, s2 = h.wait(["s1", "s2"], timeout=30.0)
        for r in (s1, s2):
            assert r.first is None and r.failed.retryable
            assert r.failed.reason.startswith("cannot reach decode node: ") and "in time" in r.failed.reason
        h.submit("live", [3, 4, 5, 6], GREEDY)
        (live,) = h.wait(["live"])
        assert live.failed is None and len(live.tokens) == 4
