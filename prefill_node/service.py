"""The prefill node.

Request lifecycle:
  1. the router sends PrefillRequest(rid, prompt, params, D's KV endpoint, xfer_id, D's blocks)
  2. the node pairs with D's receiver (once per D: a step per tick, the loop serving on; the
     requests for D wait, and fail after --kv-connect-timeout-s if it cannot be paired), opens
     the transfer, queues the prompt with max_tokens = 1 (chunked prefill, batched with other
     prompts, its own prefix cache)
  3. each step, the BlockShipper ships every block that became full (the partial last block
     once the whole prompt is computed), zero-copy, pinned until sent
  4. the step that samples the first token sends it to the router at once (FirstToken), then
     Commit to D; the prompt's full blocks stay in this node's prefix cache; a Commit whose send
     times out (D stopped draining) is a RequestFailed after the first token: the router aborts
     the request at D, which would hold it until the lease, and migrates it; D is lost with
     every transfer to it, and its other requests of the same step fail before their first tokens
  5. AbortRequest, a bad request or a failed transfer: the engine drops the request, the
     transfer is aborted, the router hears RequestFailed; blocks are freed exactly once

A structured output's grammar compiles off the loop (engine/grammar_jobs.py), at the router's
CompileGrammar, beside its decode node's compile and before any reservation (answered GrammarReady
once compiled: node_shell/service.py); a PrefillRequest whose grammar is not compiled (yet, or
any more) is parked (engine/grammar_waits.py) and started once it is; the loop heartbeats and
serves the others meanwhile. Too many compiles, or one past the time limit (the router takes the
decode node's answer first, so a timeout here is of a grammar the decode node compiled in time:
this node's load), is a Busy, which the router answers with a 503; a grammar that does not
compile is a RequestFailed (a 400).
"""
from __future__ import annotations

import dataclasses
import logging

from engine.grammar_jobs import GrammarBusy, GrammarTimeout
from pdwire.outputs import RequestOutput
from pdwire.sampling_params import SamplingParams
from pdwire.control import (TRANSFER_FAILED, UNREACHABLE_DECODE, AbortRequest, CompileGrammar, FirstToken,
                            PrefillRequest, RequestFailed)
from pdwire.handshake import HandshakeError, PeerIdentity
from kvtransport.base import TransportError
from kvtransport.metrics import SenderMetrics
from pdwire.schema import ProtocolError
from node_shell.config import NodeConfig
from node_shell.service import NodeService
from kvtransport.factory import make_sender
from node_shell.shipper import SEND_TIMEOUT_S, BlockShipper, Shipment

log = logging.getLogger(__name__)


class PrefillService(NodeService):
    role = "prefill"
    # the router judges a grammar by its decode node's answer first: past this node's time limit
    # it is this node's load, a Busy (a 503), not a 400
    busy_errors = (GrammarBusy, GrammarTimeout)

    def __init__(self, config: NodeConfig):
        self.shipper = BlockShipper(config.kv_layer_groups, config.kv_layer_group_min_blocks)
        self._params: dict[str, SamplingParams] = {}    # rid -> the request's own parameters
        self._unpaired: dict[str, list[PrefillRequest]] = {}   # D's endpoint -> requests waiting for its pairing
        super().__init__(config, observer=self.shipper)

    def open_transport(self, identity: PeerIdentity, secret: bytes) -> None:
        self.sender = make_sender(self.config.kv_transport, identity, secret,   # sends on the loop: bounded
                                  device=str(self.engine.runner.kv_cache.device), p2p_host=self.config.p2p_host,
                                  max_batch_bytes=self.config.kv_batch_bytes, send_timeout=SEND_TIMEOUT_S,
                                  max_poll_s=self.config.kv_poll_s)
        self.shipper.bind(self.engine, self.sender)

    @property
    def transfer_metrics(self) -> SenderMetrics:
        return self.sender.metrics

    # -- the loop's hooks -------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        for msg in self.link.poll(timeout, self.sender.waitables()):    # replies and pairing steps wake it too
            if isinstance(msg, PrefillRequest):
                self._unpaired.setdefault(msg.kv_endpoint, []).append(msg)
            elif isinstance(msg, CompileGrammar):
                self.compile_grammar(msg)
            elif isinstance(msg, AbortRequest):
                self._abort(msg.rid, "aborted by the router", notify=False)
        self._pair()
        self.settle(self._start)
        self._fail_lost_transfers()
        self.shipper.release_sent()

    def _fail_lost_transfers(self) -> None:
        """Fail the requests whose transfers the sender lost (once: not those closed, already
        failed or committed)."""
        for failed in self.sender.poll(0.0):
            rid = next((r for r, s in self.shipper.shipments.items()
                        if s.xfer_id == failed.xfer_id and not s.closed), None)
            if rid is not None:
                self._abort(rid, f"{TRANSFER_FAILED}: {failed.reason.value} {failed.detail}", notify=True)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for rid, why in self.shipper.take_failed().items():     # a send failed inside the step
            self._abort(rid, why, notify=True)
        self._fail_lost_transfers()         # e.g. with that send's receiver: before their first tokens
        for out in outputs:
            shipment = self.shipper.shipments.get(out.request_id)
            if not out.finished or shipment is None or shipment.closed:
                continue
            first = out.outputs[0]
            if first.finish_reason == "abort" or not first.token_ids:     # (its grammar refused every token)
                self._abort(out.request_id, "the request ended with no first token (aborted)", notify=True,
                            retryable=False)
                continue
            token = first.token_ids[0]
            logprobs = [list(kv) for kv in first.logprobs[0].items()] if first.logprobs else None
            prompt = None if out.prompt_logprobs is None else \
                [None if e is None else [list(kv) for kv in e.items()] for e in out.prompt_logprobs]
            try:    # non-finite scores, or more than one control message carries, fail the request
                self.link.send(FirstToken(out.request_id, token, first.text, logprobs,
                                          self._finish_reason(out.request_id, first.finish_reason), prompt))
            except ProtocolError as err:    # (not retryable: no node could send them)
                self._abort(out.request_id, f"cannot send the first token: {err}", notify=True, retryable=False)
                continue
            self.shipper.close(out.request_id)
            self._params.pop(out.request_id, None)
            try:
                self.sender.commit(shipment.xfer_id, token, shipment.prompt_len)
            except TransportError as err:
                self.link.send(RequestFailed(out.request_id, f"{TRANSFER_FAILED}: its Commit was not sent: {err}"[:500],
                                             True))
                self._fail_lost_transfers()     # the decode node's other requests: before their first tokens

    def needs_poll(self) -> bool:
        """With no step to run, every shipment is closed and waits only for its bytes to leave,
        to unpin its blocks: no socket says when."""
        return bool(self.shipper.shipments)

    def close_transport(self) -> None:
        self.sender.close()
        self.shipper.release_all()

    # -- requests ---------------------------------------------------------------------------
    def _pair(self) -> None:
        """A step of each pairing that requests wait for (none waits for a paired D's): they start
        once their D is paired, or fail (retryably) if it cannot be."""
        for endpoint in list(self._unpaired):
            try:
                if self.sender.try_connect(endpoint, self.config.kv_connect_timeout_s) is None:
                    continue
                error = ""
            except (HandshakeError, RuntimeError, ValueError) as e:
                error = f"{UNREACHABLE_DECODE}: {e}"[:500]
            for req in self._unpaired.pop(endpoint):
                if error:
                    self.link.send(RequestFailed(req.rid, error, True))
                else:
                    self._start(req)

    def _start(self, req: PrefillRequest) -> None:
        if not self._grammar_ready(req.rid, req.params, req):
            return
        try:
            self.sender.begin(req.xfer_id, req.kv_endpoint)
        except (HandshakeError, RuntimeError, ValueError) as e:
            self.link.send(RequestFailed(req.rid, f"{UNREACHABLE_DECODE}: {e}"[:500], True))
            return
        try:    # P samples the first token only (min_tokens > 0 still bans EOS on it)
            prefill_params = dataclasses.replace(req.params, max_tokens=1, n=1,
                                                 min_tokens=min(req.params.min_tokens, 1))
            self.engine.add_request(req.rid, list(req.prompt_ids), prefill_params, req.prior_outputs)
        except (GrammarBusy, ValueError) as e:
            self.sender.abort(req.xfer_id, "bad request")
            return self._refuse(req.rid, e)
        self._params[req.rid] = req.params
        self.shipper.track(Shipment(req.rid, req.xfer_id, tuple(req.dst_block_ids), len(req.prompt_ids),
                                    req.cached_prefix_blocks))


    def fail(self, rid: str, reason: str) -> None:
        self._abort(rid, reason, notify=True)

    def drop_all(self) -> None:
        """The router's session was lost: every request here is the router's to run again."""
        for rid in list(self.shipper.shipments):
            self._abort(rid, "the router's session was lost", notify=False)
        self._compiling.clear()
        for waiting in self._unpaired.values():     # their pairings go on (a later request may use them)
            waiting.clear()

    def _abort(self, rid: str, reason: str, notify: bool, retryable: bool = True) -> None:
        if notify:      # before the transfer's abort, whose echo from the decode node says less
            self.link.send(RequestFailed(rid, reason[:500], retryable))
        for waiting in self._unpaired.values():
            waiting[:] = [r for r in waiting if r.rid != rid]
        self._compiling.drop(rid)
        self.engine.abort_request(rid)
        shipment = self.shipper.close(rid)
        if shipment is not None:
            self._send_or_lose(lambda: self.sender.abort(shipment.xfer_id, reason[:200]))
        self._params.pop(rid, None)

    @staticmethod
    def _send_or_lose(send) -> None:
        """An Abort; one into a decode node that stopped draining times out (the sender loses it,
        failing its other transfers): that node fails the transfer itself, when this node's
        silence or the lease runs out."""
        try:
            send()
        except TransportError as err:
            log.warning("%s", err)

    def _finish_reason(self, rid: str, local: str | None) -> str:
        """The request's own finish reason if its first token already ends it, else ""."""
        params = self._params.get(rid)
        if local == "stop":
            return "stop"
        if params is not None and params.max_tokens == 1:
            return "length"
        return ""
