"""Runs real prefill and decode node services on threads, with the test acting as the router
over a real ZMQ ROUTER socket speaking the control protocol."""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import zmq

from decode_node.service import DecodeService
from node_shell.config import NodeConfig
from node_shell.runtime import run
from pdwire.control import (CompileGrammar, DecodeRequest, FirstToken, GrammarReady, KVEvents, NodeCommand,
                            NodeHello, NodeStatus, PrefillRequest, RequestFailed, TokenDelta)
from pdwire.messages import Busy, Reserved
from kvtransport.secret import write_secret
from kvtransport.testing import TEST_SECRET
from kvtransport.zmtp_auth import ThreadGuard
from prefill_node.service import PrefillService
from tests.control_peer import RouterEnd

_SECRET_DIR = tempfile.mkdtemp(prefix="pdserve-test-")
# Only bounds a hang (a node that never answers): waits are for events, and a starved 2-core CI
# machine may take minutes for what takes seconds here. Under pytest's own 600 s per test.
HANG_S = 300.0


def settled(service: PrefillService | DecodeService) -> bool:
    """Nothing in flight on the node: no request in its engine, no shipment whose bytes have not
    all left (needs_poll), and on a decode node no transfer open and no KV move holding blocks."""
    if service.engine.has_unfinished_requests() or service.needs_poll():
        return False
    return not isinstance(service, DecodeService) or not (service.xfer_rid or service.mover.held)


def secret_file() -> str:
    """A 0600 file holding the test cluster secret (made once per test process)."""
    path = os.path.join(_SECRET_DIR, "cluster-secret")
    if not os.path.exists(path):
        write_secret(path, TEST_SECRET)
    return path


@dataclass
class Result:
    tokens: dict[int, int] = field(default_factory=dict)      # index -> token id
    text: str = ""
    first: FirstToken | None = None
    finish: str = ""
    failed: RequestFailed | None = None
    failures: list[tuple[str, RequestFailed]] = field(default_factory=list)   # (node, message), in order
    reserved: Reserved | None = None
    compiled: list[str] = field(default_factory=list)       # nodes that answered GrammarReady


class NodeHarness:
    def __init__(self, model_path: str, prefill_tp: int = 1, decode_tp: int = 1, **node_kwargs):
        self.ctx = zmq.Context()
        self.guard = ThreadGuard(self.ctx, TEST_SECRET)
        self.guard.start()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.guard.protect(self.sock)
        self.sock.bind("tcp://127.0.0.1:0")
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        cfg = dict(router=endpoint, model=model_path, cluster_secret_file=secret_file(), **node_kwargs)
        self.end = RouterEnd()
        self.prefill = PrefillService(NodeConfig(node_id="prefill-0", tensor_parallel_size=prefill_tp, **cfg))
        self.decode = DecodeService(NodeConfig(node_id="decode-0", tensor_parallel_size=decode_tp, **cfg))
        self.hellos: dict[str, NodeHello] = {}
        self.results: dict[str, Result] = {}
        self.pending: dict[str, DecodeRequest] = {}     # rid -> its DecodeRequest, until reserved
        self.cached: dict[str, set[bytes]] = {"prefill-0": set(), "decode-0": set()}  # by the KV events
        self.evicted: dict[str, int] = {"prefill-0": 0, "decode-0": 0}              # hashes they removed
        self.intact: dict[str, bool] = {}         # node -> block conservation held when it closed
        self.beats: Counter[str] = Counter()      # node -> NodeStatus heartbeats received
        self.threads = [threading.Thread(target=self._serve, args=(s,), daemon=True)
                        for s in (self.prefill, self.decode)]
        for t in self.threads:
            t.start()
        self.pump(until=lambda: len(self.hellos) == 2)

    def _serve(self, service) -> None:
        self.intact[service.config.node_id] = run(service)

    def send(self, node_id: str, msg) -> None:
        self.sock.send_multipart(self.end.seal(node_id, msg))

    def pump(self, until, timeout: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out waiting for the nodes"
            if self.sock.poll(50):
                replies, node, msg = self.end.receive(self.sock.recv_multipart())
                for frames in replies:
                    self.sock.send_multipart(frames)
                if msg is not None:
                    self._on(node, msg)

    def _on(self, node: str, msg) -> None:
        if isinstance(msg, NodeHello):
            self.hellos[node] = msg
        if isinstance(msg, (NodeHello, NodeStatus)):
            self.beats[node] += isinstance(msg, NodeStatus)
            return self.send(node, NodeCommand("ok"))
        if isinstance(msg, KVEvents):
            held = self.cached[node] = set() if msg.reset else self.cached[node]
            self.evicted[node] += len(msg.removed)
            return held.update(msg.stored) or held.difference_update(msg.removed)
        rid = getattr(msg, "rid", None)
        if rid is None or rid not in self.results:
            return
        r = self.results[rid]
        if isinstance(msg, Reserved):
            r.reserved = msg
            req = self.pending.pop(rid)
            if req.local_prefill:
                return
            self.send("prefill-0", PrefillRequest(rid, req.prompt_ids, req.params, self.hellos["decode-0"].kv_endpoint,
                                                  msg.xfer_id, msg.dst_block_ids, msg.cached_prefix_blocks,
                                                  req.prior_outputs))
        elif isinstance(msg, GrammarReady):
            r.compiled.append(node)
            if len(r.compiled) == 2 and rid in self.pending:    # as the router: reserve once both hold it
                self.send("decode-0", self.pending[rid])
        elif isinstance(msg, Busy):
            r.failed = RequestFailed(rid, "busy", True)
        elif isinstance(msg, FirstToken):
            r.first, r.tokens[0] = msg, msg.token_id
        elif isinstance(msg, TokenDelta):
            for i, t in enumerate(msg.token_ids):
                r.tokens[msg.index + i] = t
            r.text = r.text[:msg.text_offset] + msg.text
            r.finish = msg.finish_reason or r.finish
        elif isinstance(msg, RequestFailed):
            r.failed = msg
            r.failures.append((node, msg))

    def submit(self, rid: str, prompt: list[int], params, prior_outputs: int = 0, local: bool = False) -> None:
        """local: the decode node prefills the prompt itself (no PrefillRequest follows). A
        structured output's grammar is compiled on both nodes first, as the router does
        (router/cluster/grammar_first.py)."""
        self.results[rid] = Result()
        self.pending[rid] = DecodeRequest(rid, tuple(prompt), params, "prefill-0", prior_outputs, local)
        if params.structured is None or local:
            return self.send("decode-0", self.pending[rid])
        for node in ("prefill-0", "decode-0"):
            self.send(node, CompileGrammar(rid, params))

    def wait(self, rids: list[str], timeout: float = HANG_S) -> list[Result]:
        self.pump(lambda: all(self.results[r].finish or self.results[r].failed for r in rids), timeout)
        return [self.results[r] for r in rids]

    def idle(self) -> None:
        """Wait until both nodes are idle and every pinned block is released."""
        self.pump(lambda: settled(self.prefill) and settled(self.decode))

    def close(self) -> None:
        for node in ("prefill-0", "decode-0"):
            self.send(node, NodeCommand("leave"))
        for t in self.threads:
            t.join(timeout=HANG_S)
        self.sock.close(linger=0)
        self.guard.stop()
        self.ctx.term()
        assert len(self.intact) == len(self.threads) and all(self.intact.values()), f"nodes closed with {self.intact}"


@contextlib.contextmanager
def serving(model_path: str, **node_kwargs) -> Iterator[NodeHarness]:
    """A NodeHarness; at the end both nodes idle, every block accounted for, no block pinned."""
    h = NodeHarness(model_path, **node_kwargs)
    yield h
    h.idle()
    h.close()
    for service in (h.prefill, h.decode):
        service.engine.check_integrity()
        assert not service.engine.block_manager.num_pins, "a shipped block stayed pinned"


def tokens(result: Result) -> list[int]:
    """A result's tokens in index order."""
    return [result.tokens[i] for i in sorted(result.tokens)]


def process_alive(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
