"""A decode node that stops draining its KV queue: the prefill node's send times out once, that
decode node is lost with every transfer to it (no send waits on its full queue again, no Commit or
Abort goes there), each of its requests fails once, retryably, and the prefill node serves on; a
request whose Commit's own send timed out fails after its first token."""
from __future__ import annotations

import threading

from engine import SamplingParams
from kvtransport.base import TransportError
from pdwire.control import AbortRequest, PrefillRequest
from tests.node_harness import HANG_S, serving, tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = list(range(3, 40))         # 5 blocks of 8


def _stall(link, endpoint: str) -> list[str]:
    """Make sends on link's present connection to endpoint time out, as into a full queue (a new
    connection is another queue); the endpoints tried."""
    tried, send, send_tracked, stalled = [], link.send, link.send_tracked, link._socks[endpoint]

    def check(to: str) -> None:
        if link._socks.get(to) is stalled:
            tried.append(to)
            raise TransportError(f"{to} not draining: send blocked 2.0s")
    link.send = lambda to, frames: check(to) or send(to, frames)
    link.send_tracked = lambda to, frames: check(to) or send_tracked(to, frames)
    return tried


def _hold_polls_until(link, rids: set[str]) -> threading.Event:
    """link's next poll returns once PrefillRequests for every rid have come: both start at once.
    The event is set once that poll has begun (an earlier poll may take a PrefillRequest)."""
    poll, entered = link.poll, threading.Event()

    def held(timeout: float, wake_on=()) -> list:
        entered.set()
        got = []
        while not rids <= {getattr(m, "rid", None) for m in got if isinstance(m, PrefillRequest)}:
            got += poll(0.01)
        link.poll = poll
        return got
    link.poll = held
    return entered


def test_a_decode_node_that_stops_draining_fails_its_requests_once_each(model_dir):
    """Two requests in flight to a decode node whose queue is full: one send times out, and only
    one (no second send, Commit or Abort into the full queue); each request fails once, retryably,
    with no first token sent for it; the prefill node then pairs with the decode node afresh and
    serves a request token for token as before."""
    with serving(model_dir[0], block_size=8, num_blocks=64) as h:
        h.submit("warm", PROMPT, GREEDY)
        (warm,) = h.wait(["warm"])
        tried = _stall(h.prefill.sender._link, h.hellos["decode-0"].kv_endpoint)
        assert _hold_polls_until(h.prefill.link, {"a", "b"}).wait(HANG_S)
        for rid in ("a", "b"):
            h.submit(rid, PROMPT, GREEDY)
        h.pump(lambda: all(any(n == "prefill-0" for n, _ in h.results[r].failures) for r in ("a", "b")))
        for rid in ("a", "b"):      # as the router does on a failed attempt (unless decode-0 saw
            h.send("decode-0", AbortRequest(rid))   # the prefill node's connection fall silent first)
        beats = h.beats["prefill-0"]
        h.pump(lambda: h.beats["prefill-0"] >= beats + 3)
        assert len(tried) == 1
        for rid in ("a", "b"):
            (failed,) = [f for node, f in h.results[rid].failures if node == "prefill-0"]
            assert failed.retryable and "transfer failed" in failed.reason
            assert h.results[rid].first is None         # its transfer was lost before its first token
        h.submit("after", PROMPT, GREEDY)
        (after,) = h.wait(["after"])
        assert after.failed is None and tokens(after) == tokens(warm) and len(tokens(warm)) == 3


def test_a_commit_whose_send_times_out_fails_its_request_after_its_first_token(model_dir):
    """The Commit's own send meets the full queue (the first token went out before it): the
    request fails, retryably, after its first token, so that the router aborts it at the decode
    node (which would hold it until its lease) and runs it again; the prefill node serves on."""
    with serving(model_dir[0], block_size=8, num_blocks=64) as h:
        h.submit("warm", PROMPT, GREEDY)
        (warm,) = h.wait(["warm"])
        sender, stalls = h.prefill.sender, []
        commit = sender.commit

        def cut(xfer_id: str, first_token: int, num_tokens: int) -> None:
            if not stalls:
                stalls.append(_stall(sender._link, h.hellos["decode-0"].kv_endpoint))
            commit(xfer_id, first_token, num_tokens)
        sender.commit = cut
        h.submit("c", PROMPT, GREEDY)
        h.pump(lambda: any(node == "prefill-0" for node, _ in h.results["c"].failures))
        (failed,) = [f for node, f in h.results["c"].failures if node == "prefill-0"]
        assert failed.retryable and "Commit" in failed.reason
        assert h.results["c"].first is not None         # after its first token
        assert stalls[0] == [h.hellos["decode-0"].kv_endpoint]      # the Commit's send, and none after it
        h.send("decode-0", AbortRequest("c"))           # as the router does
        h.submit("after", PROMPT, GREEDY)
        (after,) = h.wait(["after"])
        assert after.failed is None and tokens(after) == tokens(warm)


def test_a_cut_commit_fails_the_other_requests_to_its_decode_node_before_their_first_tokens(model_dir):
    """Two requests to one decode node finish in the same step and the first one's Commit send
    times out: that loses the decode node with the other's transfer, so the other fails too,
    retryably and before its first token (not a first token and then silence while the decode
    node holds its reservation until the lease); each fails once."""
    with serving(model_dir[0], block_size=8, num_blocks=64) as h:
        h.submit("warm", PROMPT, GREEDY)
        (warm,) = h.wait(["warm"])
        sender, stalls, committed = h.prefill.sender, [], []
        commit = sender.commit

        def cut(xfer_id: str, first_token: int, num_tokens: int) -> None:
            committed.append(xfer_id)
            if not stalls:
                stalls.append(_stall(sender._link, h.hellos["decode-0"].kv_endpoint))
            commit(xfer_id, first_token, num_tokens)
        sender.commit = cut
        assert _hold_polls_until(h.prefill.link, {"a", "b"}).wait(HANG_S)
        for rid in ("a", "b"):
            h.submit(rid, PROMPT, GREEDY)
        h.pump(lambda: all(any(n == "prefill-0" for n, _ in h.results[r].failures) for r in ("a", "b")))
        for rid in ("a", "b"):
            h.send("decode-0", AbortRequest(rid))           # as the router does
        beats = h.beats["prefill-0"]
        h.pump(lambda: h.beats["prefill-0"] >= beats + 3)   # no second failure comes later
        (cut_rid,) = [r for r in ("a", "b") if h.results[r].first is not None]
        (other,) = {"a", "b"} - {cut_rid}
        assert len(committed) == 1 and stalls[0] == [h.hellos["decode-0"].kv_endpoint]
        for rid, said in ((cut_rid, "Commit"), (other, "transfer failed")):
            (failed,) = [f for node, f in h.results[rid].failures if node == "prefill-0"]
            assert failed.retryable and said in failed.reason
        h.submit("after", PROMPT, GREEDY)
        (after,) = h.wait(["after"])
        assert after.failed is None and tokens(after) == tokens(warm)
