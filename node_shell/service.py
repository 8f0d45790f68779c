"""The lifecycle every node kind shares; a prefill or decode node adds only what differs.

    NodeService(config)
      1. the cluster secret (a node without one refuses to start), the engine, the KV identity
      2. open_transport(): the node kind's sender or receiver
      3. the link to the router: an authenticated session, then NodeHello (kv_endpoint, blocks)
      4. serving (node_shell.runtime.run): poll(), the engine's steps, on_outputs(), and the
         prefix cache's KV events to the router (kv_publisher.py); a CompileGrammar starts its
         grammar's compile off the loop (engine/grammar_jobs.py) and is answered GrammarReady
         once it compiled, so the router reserves KV only for a grammar both nodes hold
      5. close(reason): NodeGoodbye to the router first, so it moves this node's work at once,
         then the transport, the link, the tensor-parallel workers and the grammar compile workers
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable

from engine.grammar_jobs import CompileJob, GrammarBusy
from engine.grammar_waits import GrammarWaits
from engine.llm_engine import LLMEngine
from engine.step_observer import StepObserver
from pdwire.outputs import RequestOutput
from pdwire.control import CompileGrammar, GrammarReady, NodeHello, NodeStatus, RequestFailed
from pdwire.messages import Busy
from pdwire.sampling_params import SamplingParams
from pdwire.handshake import new_epoch
from kvtransport.metrics import ReceiverMetrics, SenderMetrics
from kvtransport.secret import load_secret
from node_shell.config import NodeConfig
from node_shell.identity import kv_identity, node_status
from node_shell.kv_publisher import KVPublisher
from node_shell.router_link import RouterLink

log = logging.getLogger(__name__)
BUSY_RETRY_MS = 50      # a Busy's retry-after (no free KV blocks, or the grammar compiler)


class NodeService(ABC):
    role: str                                        # "prefill" | "decode"
    busy_errors: tuple[type[Exception], ...] = (GrammarBusy,)   # a grammar error another node may not meet

    def __init__(self, config: NodeConfig, observer: StepObserver | None = None) -> None:
        self.config = config
        self.epoch = new_epoch()                     # this process's KV identity (the link has its own)
        secret = load_secret(config.cluster_secret_file)
        log.info("%s node %s: loading the model %s", self.role, config.node_id, config.model or "(built-in)")
        self.engine = LLMEngine(config.engine_config(), observer=observer)
        self.open_transport(kv_identity(self.engine, config.node_id, self.epoch, config.kv_transport), secret)
        self.link = RouterLink(config.router, secret, self._hello, self._status, config.heartbeat_s,
                               config.router_timeout_s, self.drop_all)
        self.kv_events = KVPublisher(self.engine.block_manager, config.node_id, self.link)
        self._compiling: GrammarWaits[Any] = GrammarWaits()     # requests parked until their grammar compiled

    def _grammar_ready(self, rid: str, params: SamplingParams, item: Any) -> bool:
        """Whether the request can start now: else it was refused (its grammar cannot compile
        here) or parked until its grammar compiled (the loop takes it back from _compiling)."""
        try:
            job = self.engine.grammar_job(params)
        except (GrammarBusy, ValueError) as e:
            self._refuse(rid, e)
            return False
        if job is not None and not job.done:
            self._compiling.park(rid, job, item)
            return False
        return True

    def compile_grammar(self, msg: CompileGrammar) -> None:
        """Start compiling the request's grammar (or find it compiled); the answer goes out at once
        if it is done, else when it settles (settle())."""
        try:
            job = self.engine.grammar_job(msg.params)
        except (GrammarBusy, ValueError) as e:
            return self._refuse(msg.rid, e)
        if job.done:
            return self._answer(msg.rid, job)
        self._compiling.park(msg.rid, job, job)

    def settle(self, start: Callable[[Any], None]) -> None:
        """Take back the requests whose grammar wait is over: a refusal, a CompileGrammar's answer,
        or `start(request)` (the node kind's own start: reserve, prefill)."""
        for rid, item, error in self._compiling.settled():
            if error is not None:
                self._refuse(rid, error)
            elif isinstance(item, CompileJob):
                self._answer(rid, item)
            else:
                start(item)

    def _answer(self, rid: str, job: CompileJob) -> None:
        """A CompileGrammar's answer, its compile done: GrammarReady, or its refusal."""
        if job.future.cancelled():      # the compiler closed
            return self._refuse(rid, GrammarBusy.closing())
        error = job.future.exception()
        if error is None:
            self.link.send(GrammarReady(rid))
        else:
            self._refuse(rid, error)

    def _refuse(self, rid: str, error: Exception) -> None:
        """Busy for busy_errors (the router tries another node, or answers a 503), else
        RequestFailed, not retryable (no node would take it: a 400)."""
        if isinstance(error, self.busy_errors):
            self.link.send(Busy(rid, str(error)[:200], BUSY_RETRY_MS))
        else:
            self.link.send(RequestFailed(rid, str(error)[:500], False))

    # -- what a node kind provides ----------------------------------------------------------
    @abstractmethod
    def open_transport(self, identity: Any, secret: bytes) -> None:
        """Make this node's KV sender or receiver."""

    @property
    @abstractmethod
    def transfer_metrics(self) -> SenderMetrics | ReceiverMetrics: ...

    @property
    def kv_endpoint(self) -> str:
        """Where prefill nodes ship blocks to this node ("" for a node that only sends)."""
        return ""

    @abstractmethod
    def poll(self, timeout: float) -> None:
        """Take control messages and transport events, waiting up to `timeout` seconds for the first
        to arrive: one wait over the router link's socket and the transport's (RouterLink.poll's
        wake_on), so that a frame ends it as soon as a control message does."""

    @abstractmethod
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Forward the outputs of one engine step."""

    @abstractmethod
    def needs_poll(self) -> bool:
        """Whether work is due that no socket poll() waits on announces (blocks pinned until their
        bytes have left: no socket says when), so that the idle loop looks again soon."""

    @abstractmethod
    def fail(self, rid: str, reason: str) -> None:
        """Tell the router request `rid` failed here (the engine has already dropped it)."""

    @abstractmethod
    def drop_all(self) -> None:
        """The router's session was lost: drop every request (the router runs them elsewhere)."""

    @abstractmethod
    def close_transport(self) -> None: ...

    # -- the shared lifecycle ---------------------------------------------------------------
    def should_stop(self) -> bool:
        return self.link.leave

    def close(self, reason: str = "") -> bool:
        """Goodbye first (the router moves this node's requests at once), then everything else.
        Returns whether the node's block accounting held to the end (block conservation, and no
        block still pinned once the transport is closed)."""
        self.link.goodbye(reason or "closed")
        self.close_transport()
        self.link.close()
        self.engine.runner.close()            # tp > 1: stop the worker processes
        if self.engine.sampler.grammars is not None:    # its compile worker processes
            self.engine.sampler.grammars.close()
        try:
            self.engine.check_integrity()
        except AssertionError as err:
            log.error("%s: block accounting broken at exit: %s", self.config.node_id, err)
            return False
        if self.engine.block_manager.num_pins:      # the transport's holds are all released by now
            log.error("%s: %d block pins left at exit", self.config.node_id, self.engine.block_manager.num_pins)
            return False
        return True

    def _hello(self, epoch: str) -> NodeHello:
        bm = self.engine.block_manager
        return NodeHello(self.config.node_id, epoch, self.role, self.kv_endpoint, bm.num_blocks,
                         bm.block_size, self.engine.max_model_len)

    def _status(self, epoch: str) -> NodeStatus:
        return node_status(self.engine, self.config.node_id, epoch, self.transfer_metrics)
