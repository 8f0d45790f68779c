"""The decode node.

Request lifecycle:
  1. the router sends DecodeRequest(rid, prompt, params, P); the engine reserves blocks for the
     prompt if there is room for it and its growth, reusing blocks its prefix cache holds;
     the answer is Reserved(xfer_id, block table, cached leading blocks) or Busy (backpressure:
     nothing is prefilled in vain)
  2. the KV receiver writes each arriving block straight into its reserved block, after checking
     it against the reservation (only P may write it, only those blocks, right size and dtype);
     a block arrives with every kv head, so at tp > 1 rank 0 keeps its heads and the other
     ranks get theirs with the next step, before it runs (TPModelRunner.write_blocks)
  3. when every expected block and the Commit (first token) arrived, the engine adopts the
     blocks and the sequence joins the running batch
  4. each step streams TokenDeltas to the router; preemption recomputes locally
  5. on finish, AbortRequest, or a failed transfer (lease expiry, P's death, P's abort) the
     blocks are freed exactly once; a failed transfer is reported as RequestFailed (retryable)
"""
from __future__ import annotations

import logging
import secrets

from engine.llm_engine import LLMEngine
from engine.node_config import NodeConfig
from engine.node_runtime import kv_identity, node_status
from pdwire.outputs import RequestOutput
from engine.parallel import close_runner
from engine.router_link import RouterLink
from decode_node.streamer import Streamer
from pdwire.control import AbortRequest, DecodeRequest, NodeHello, NodeStatus, RequestFailed
from kvtransport.events import TransferCommitted, TransferFailed
from pdwire.handshake import new_epoch
from pdwire.messages import Busy, Reserved
from kvtransport.payload import BlockWriterSink
from kvtransport.receiver_state import Reservation
from kvtransport.secret import load_secret
from kvtransport.torch_dist import DistReceiver
from kvtransport.zmq_receiver import ZmqReceiver

log = logging.getLogger(__name__)
BUSY_RETRY_MS = 50


class DecodeService:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.epoch = new_epoch()
        secret = load_secret(config.cluster_secret_file)
        self.engine = e = LLMEngine(config.engine_config())
        identity = kv_identity(e, config.node_id, self.epoch, config.kv_transport)
        # tp = 1: bytes straight into the pool; tp > 1: the runner spreads each block's heads
        write_blocks = e.runner.block_writer()
        if config.kv_transport == "torch_dist":
            self.receiver = DistReceiver(e.runner.kv_cache, identity, secret, bind=config.kv_bind,
                                         p2p_host=config.p2p_host, write_blocks=write_blocks)
        else:
            sink = BlockWriterSink(write_blocks, identity.layout) if write_blocks else None
            self.receiver = ZmqReceiver(e.runner.kv_cache, identity, secret, bind=config.kv_bind, sink=sink)
        self.streamer = Streamer()
        self.xfer_rid: dict[str, str] = {}          # open transfers: xfer_id -> rid
        self.aborted: set[str] = set()              # rids the router aborted mid-transfer
        self.link = RouterLink(config.router, secret, self._hello, self._status, config.heartbeat_s,
                               config.router_timeout_s, self._drop_all)

    def _hello(self, epoch: str) -> NodeHello:
        bm = self.engine.block_manager
        return NodeHello(self.config.node_id, epoch, "decode", self.receiver.endpoint, bm.num_blocks,
                         bm.block_size, self.engine.max_model_len)

    def _status(self, epoch: str) -> NodeStatus:
        return node_status(self.engine, self.config.node_id, epoch, self.receiver.metrics)

    # -- the loop's hooks -------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        for msg in self.link.poll(timeout):
            if isinstance(msg, DecodeRequest):
                self._reserve(msg)
            elif isinstance(msg, AbortRequest):
                self._abort(msg.rid)
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

    def busy(self) -> bool:
        return bool(self.xfer_rid)

    def should_stop(self) -> bool:
        return self.link.leave

    def close(self) -> None:
        for failed in self.receiver.close() or ():      # transfers still open: free their blocks
            rid = self.xfer_rid.pop(failed.xfer_id, None)
            if rid is not None:
                self.engine.abort_request(rid)
        self.link.close()
        close_runner(self.engine.runner)      # tp > 1: stop the worker processes

    # -- requests ---------------------------------------------------------------------------
    def _reserve(self, req: DecodeRequest) -> None:
        prompt = list(req.prompt_ids)
        room = self.engine.max_model_len - len(prompt)
        growth = min(room, req.params.max_tokens or room)
        try:
            reserved = self.engine.reserve(req.rid, prompt, req.params, max(growth, 0), req.prior_outputs)
        except ValueError as e:
            self.link.send(RequestFailed(req.rid, str(e)[:500], False))
            return
        if reserved is None:
            self.link.send(Busy(req.rid, "no free KV blocks", BUSY_RETRY_MS))
            return
        table, cached = reserved
        xfer_id = secrets.token_hex(16)      # unguessable; only req.prefill_node_id may write it
        self.receiver.register(Reservation(xfer_id, tuple(table), cached, self.config.lease_s,
                                           sender_node_id=req.prefill_node_id, num_tokens=len(prompt)))
        self.xfer_rid[xfer_id] = req.rid
        self.streamer.open(req.rid)
        self.link.send(Reserved(req.rid, xfer_id, tuple(table), cached))

    def fail(self, rid: str, reason: str) -> None:
        self.streamer.drop(rid)
        self.link.send(RequestFailed(rid, reason, True))

    def _drop_all(self) -> None:
        """The router's session was lost: every request here is the router's to run again."""
        for rid in list(self.streamer.streams):
            self._abort(rid)

    def _abort(self, rid: str) -> None:
        xfer_id = next((x for x, r in self.xfer_rid.items() if r == rid), None)
        if xfer_id is not None:
            self.aborted.add(rid)
            self.receiver.abort(xfer_id, "aborted by the router")   # its TransferFailed frees the blocks
        else:
            self.engine.abort_request(rid)
            self.streamer.drop(rid)
