"""The decode node.

Request lifecycle:
  1. the router sends DecodeRequest(rid, prompt, params, P); the engine reserves blocks for the
     prompt if there is room for it and its growth, reusing blocks its prefix cache holds;
     the answer is Reserved(xfer_id, block table, cached leading blocks, blocks taken from the
     free ones) or Busy (backpressure: nothing is prefilled in vain)
  2. the KV receiver writes each arriving block straight into its reserved block, after checking
     it against the reservation (only P may write it, only those blocks, right size and dtype);
     a block arrives with every kv head, so at tp > 1 rank 0 keeps its heads and the other
     ranks get theirs with the next step, before it runs (TPModelRunner.write_blocks)
  3. when every expected block and the Commit (first token) arrived, the engine adopts the
     blocks and the sequence joins the running batch (a node with nothing to step meanwhile
     sleeps on the receiver's socket and the router's, woken by the first frame: node_shell/runtime.py)
  4. each step streams TokenDeltas to the router; preemption recomputes locally
  5. on finish, AbortRequest, or a failed transfer (lease expiry, P's death, P's abort) the
     blocks are freed exactly once; a failed transfer is reported as RequestFailed (retryable)

A KV move (an operator's remove or drain deadline; decode_node/mover.py) makes this node the
sender of a running request, and another decode node the receiver:
  6. PauseRequest: the request stops between two steps, its blocks are pinned, Paused(n tokens)
     follows its last TokenDelta; ShipRequest: the blocks go into the other node's reservation
     (this node named as its writer) with the transport and BlockBatch / Commit path of a prefill
     node, the last token sampled here committed as the first; the pins go once the bytes left
  7. as the receiver, nothing differs from steps 1-3: the DecodeRequest names the sending decode
     node as the writer, with the tokens generated before as prior outputs, and the Commit's
     first token is the one the sender sampled last (the router has sent it already)

A DecodeRequest with local_prefill (the router found all but a few of the prompt's tokens cached
here) skips steps 2-3: the reservation joins the batch at once, the engine prefills the uncached
tail in chunks beside its decodes and samples the first token itself, which goes out as the first
TokenDelta (index 0); no prefill node takes part and nothing is shipped.

A structured output's grammar compiles off the loop (engine/grammar_jobs.py): at the router's
CompileGrammar, beside its prefill node's compile and before step 1 (answered GrammarReady once
compiled: node_shell/service.py), so no KV is reserved while either node compiles; a DecodeRequest
whose grammar is not compiled (a local prefill, a KV move) is parked (engine/grammar_waits.py)
and reserved once it is; the loop heartbeats and serves the others meanwhile. Too many compiles:
Busy.
"""
from __future__ import annotations

import logging
import secrets

from decode_node.streamer import Streamer
from engine.grammar_jobs import GrammarBusy
from pdwire.outputs import RequestOutput
from pdwire.control import (AbortRequest, CompileGrammar, DecodeRequest, Paused, PauseRequest, RequestFailed,
                            ShipRequest)
from decode_node.mover import KVMover
from node_shell.shipper import SEND_TIMEOUT_S
from kvtransport.events import TransferCommitted, TransferFailed
from pdwire.handshake import PeerIdentity
from pdwire.messages import Busy, Reserved, batch_blocks
from kvtransport.metrics import ReceiverMetrics
from kvtransport.factory import make_receiver, make_sender
from kvtransport.receiver_state import Reservation
from node_shell.config import NodeConfig
from node_shell.service import BUSY_RETRY_MS, NodeService

log = logging.getLogger(__name__)
LOCAL_XFER_ID = "local"     # Reserved's xfer_id for a local prefill: names no transfer


class DecodeService(NodeService):
    role = "decode"

    def __init__(self, config: NodeConfig):
        self.streamer = Streamer()
        self.xfer_rid: dict[str, str] = {}          # open transfers: xfer_id -> rid
        self.aborted: set[str] = set()              # rids the router aborted mid-transfer
        super().__init__(config)

    def open_transport(self, identity: PeerIdentity, secret: bytes) -> None:
        runner, config = self.engine.runner, self.config
        # tp = 1: bytes straight into the pool; tp > 1: the runner spreads each block's heads
        self.receiver = make_receiver(config.kv_transport, runner.kv_cache, identity, secret, bind=config.kv_bind,
                                      p2p_host=config.p2p_host, write_blocks=runner.block_writer(),
                                      payload_wait_s=config.kv_payload_wait_s, max_batch_bytes=config.kv_batch_bytes,
                                      max_queue_bytes=config.kv_recv_queue_bytes,
                                      split_payloads=config.kv_split_payloads, max_poll_s=config.kv_poll_s)
        sender = lambda: make_sender(config.kv_transport, identity, secret,  # noqa: E731 -- at the first move
                                     device=str(runner.kv_cache.device), p2p_host=config.p2p_host,
                                     max_batch_bytes=config.kv_batch_bytes, send_timeout=SEND_TIMEOUT_S,
                                     max_poll_s=config.kv_poll_s,
                                     split_payloads=False)     # each send one message: the mover's deadline
        self.mover = KVMover(self.engine, sender, config.lease_s,
                             batch_blocks(identity.layout.block_nbytes, config.kv_batch_bytes))

    @property
    def transfer_metrics(self) -> ReceiverMetrics:
        return self.receiver.metrics

    @property
    def kv_endpoint(self) -> str:
        return self.config.kv_advertised(self.receiver.endpoint)

    # -- the loop's hooks -------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        for msg in self.link.poll(timeout, self.receiver.waitables() + self.mover.waitables()):
            if isinstance(msg, DecodeRequest):
                self._reserve(msg)
            elif isinstance(msg, CompileGrammar):
                self.compile_grammar(msg)
            elif isinstance(msg, AbortRequest):
                self._abort(msg.rid)
                self.mover.release(msg.rid)
            elif isinstance(msg, PauseRequest):
                self.link.send(self._pause(msg.rid))
            elif isinstance(msg, ShipRequest):
                self.link.beat_if_due()     # each ship may hold the loop MAX_LOOP_STALL_S: a beat between two
                if (failed := self.mover.ship(msg)) is not None:
                    self.link.send(failed)
        self.settle(self._reserve)
        self.mover.tick()
        for event in self.receiver.poll(0.0):
            rid = self.xfer_rid.pop(event.xfer_id, None)
            if rid is None:
                continue
            if isinstance(event, TransferCommitted):
                self.on_outputs([self.engine.adopt(rid, event.first_token)])
            elif isinstance(event, TransferFailed):
                self.engine.abort_request(rid)
                self.streamer.drop(rid)
                if rid in self.aborted:
                    self.aborted.discard(rid)
                    continue
                self.link.send(RequestFailed(rid, f"transfer failed: {event.reason.value} {event.detail}"[:500],
                                             True))

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            delta = self.streamer.delta(out)
            if delta is not None:
                self.link.send(delta)

    def needs_poll(self) -> bool:
        """A transfer's frames all come through the receiver's socket, which poll() waits on, so
        only a KV move's pins (released once their bytes have left) need looking at soon."""
        return self.mover.needs_poll()

    def close_transport(self) -> None:
        self.mover.close()
        for failed in self.receiver.close() or ():      # transfers still open: free their blocks
            rid = self.xfer_rid.pop(failed.xfer_id, None)
            if rid is not None:
                self.engine.abort_request(rid)

    # -- requests ---------------------------------------------------------------------------
    def _reserve(self, req: DecodeRequest) -> None:
        if not self._grammar_ready(req.rid, req.params, req):
            return
        prompt = list(req.prompt_ids)
        room = self.engine.max_model_len - len(prompt)
        growth = min(room, req.params.max_tokens or room)
        try:
            reserved = self.engine.reserve(req.rid, prompt, req.params, max(growth, 0), req.prior_outputs)
        except (GrammarBusy, ValueError) as e:
            return self._refuse(req.rid, e)
        if reserved is None:
            self.link.send(Busy(req.rid, "no free KV blocks", BUSY_RETRY_MS))
            return
        table, cached, taken = reserved
        if req.local_prefill:
            return self._prefill_here(req, table, cached, taken)
        xfer_id = secrets.token_hex(16)      # unguessable; only req.prefill_node_id may write it
        self.receiver.register(Reservation(xfer_id, tuple(table), cached, self.config.lease_s,
                                           sender_node_id=req.prefill_node_id, num_tokens=len(prompt)))
        self.xfer_rid[xfer_id] = req.rid
        self.streamer.open(req.rid)
        self.link.send(Reserved(req.rid, xfer_id, tuple(table), cached, taken))

    def _prefill_here(self, req: DecodeRequest, table: list[int], cached: int, taken: int) -> None:
        """Step 1's reservation, computed here: no transfer is registered, so no peer may write it."""
        self.engine.prefill_reserved(req.rid)
        self.streamer.open(req.rid)
        self.link.send(Reserved(req.rid, LOCAL_XFER_ID, tuple(table), cached, taken))

    def fail(self, rid: str, reason: str) -> None:
        self.streamer.drop(rid)
        self.link.send(RequestFailed(rid, reason, True))

    def drop_all(self) -> None:
        """The router's session was lost: every request here is the router's to run again."""
        for rid in list(self.streamer.streams):
            self._abort(rid)
        self._compiling.clear()
        self.mover.drop_all()

    def _pause(self, rid: str) -> Paused:
        """Step 6's pause; a request whose blocks are still arriving is dropped, nothing held."""
        state = self.streamer.streams.get(rid)
        if state is None or rid in self.xfer_rid.values():
            self._abort(rid)
            return Paused(rid, 0, 0)
        self.streamer.drop(rid)
        return self.mover.pause(rid, state.tokens, state.before_last)

    def _abort(self, rid: str) -> None:
        if self._compiling.drop(rid) is not None:
            return
        xfer_id = next((x for x, r in self.xfer_rid.items() if r == rid), None)
        if xfer_id is not None:
            self.aborted.add(rid)
            self.receiver.abort(xfer_id, "aborted by the router")   # its TransferFailed frees the blocks
        else:
            self.engine.abort_request(rid)
            self.streamer.drop(rid)
