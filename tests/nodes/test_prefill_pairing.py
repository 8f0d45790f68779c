"""A prefill node pairs with a decode node a step per tick (KVSender.try_connect): a decode
endpoint that never answers holds up only the requests for it; the node heartbeats and serves every
other request meanwhile, and those requests fail, retryably, once --kv-connect-timeout-s passes."""
from __future__ import annotations

import contextlib
import socket
import threading

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


class Gate:
    """A decode endpoint whose listener the kernel accepts connections for but that answers nothing
    (as `silent`) until open(target): from then on it relays each connection, the one waiting
    too, byte for byte both ways to target (a decode node that answers late)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = [self._listener]

    def open(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        threading.Thread(target=self._accept, args=((host, int(port)),), daemon=True).start()

    def _accept(self, target: tuple[str, int]) -> None:
        while True:
            try:
                conn = self._listener.accept()[0]
            except OSError:         # closed
                return
            peer = socket.create_connection(target)
            self._socks += [conn, peer]
            for src, dst in ((conn, peer), (peer, conn)):
                threading.Thread(target=self._relay, args=(src, dst), daemon=True).start()

    @staticmethod
    def _relay(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.close()


def _prefill_for(h, rid: str, endpoint: str) -> None:
    """The router's PrefillRequest for rid, naming endpoint as the decode node's receiver."""
    h.results[rid] = Result()
    h.send("prefill-0", PrefillRequest(rid, (5, 6, 7), GREEDY, endpoint, f"xfer-{rid}", (1,), 0))


def test_a_silent_decode_node_holds_up_only_its_own_requests(model_dir, gate):
    """While a PrefillRequest for a silent decode node waits for its pairing (timeout 60 s), the
    prefill node keeps heartbeating and serves a request for the live decode node to the end; the
    waiting request is aborted, then the decode node answers and the pairing completes: the aborted
    request never starts (no first token, no failure, nothing begun or shipped)."""
    with serving(model_dir[0], block_size=8, num_blocks=48, kv_connect_timeout_s=60.0) as h:
        _prefill_for(h, "stalled", gate.endpoint)
        beats = h.beats["prefill-0"]
        h.submit("live", [3, 4, 5, 6], GREEDY)
        (live,) = h.wait(["live"])
        h.pump(lambda: h.beats["prefill-0"] >= beats + 3)
        assert live.failed is None and len(live.tokens) == 4
        assert h.results["stalled"] == Result()            # still waiting: no token, no failure
        sent = (h.prefill.sender.metrics.blocks_sent, h.prefill.sender.metrics.commits_sent)
        h.send("prefill-0", AbortRequest("stalled"))
        h.pump(lambda: h.beats["prefill-0"] >= beats + 5)
        gate.open(h.hellos["decode-0"].kv_endpoint)
        h.pump(lambda: gate.endpoint in h.prefill.sender._remotes)      # paired through the gate
        h.pump(lambda: h.beats["prefill-0"] >= beats + 8)
        assert h.results["stalled"] == Result()
        assert (h.prefill.sender.metrics.blocks_sent, h.prefill.sender.metrics.commits_sent) == sent
        assert not h.prefill.sender._core.is_open("xfer-stalled") and "stalled" not in h.prefill.shipper.shipments


def test_requests_for_a_silent_decode_node_fail_retryably_at_the_timeout(model_dir, silent):
    """Two requests waiting for the same silent decode node both fail, retryably, once the
    pairing's timeout (1 s) passes; the node then serves a request for the live decode node."""
    with serving(model_dir[0], block_size=8, num_blocks=48, kv_connect_timeout_s=1.0) as h:
        _prefill_for(h, "s1", silent)
        _prefill_for(h, "s2", silent)
        s1, s2 = h.wait(["s1", "s2"])
        for r in (s1, s2):
            assert r.first is None and r.failed.retryable
            assert r.failed.reason.startswith("cannot reach decode node: ") and "in time" in r.failed.reason
        h.submit("live", [3, 4, 5, 6], GREEDY)
        (live,) = h.wait(["live"])
        assert live.failed is None and len(live.tokens) == 4
