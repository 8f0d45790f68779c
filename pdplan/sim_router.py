"""The simulated router of a disaggregated deployment (router/cluster/admission.py):

  1. a request arrives; after the serving path's own cost (overheads.request_s, and
     overheads.prompt_token_s + admit_token_s per prompt token) it is admitted:
     the least loaded decode node with room reserves its blocks
  2. no decode node has room by the router's view (decode_pool.py): it waits, in arrival order,
     until a decode request ends somewhere or a decode node's heartbeat comes, or its timer
     fires (50 ms doubling to 1 s: then the first ranked node is asked whatever the view says)
  3. reserved: when at most local_prefill_tokens of the prompt are not cached on the decode node,
     the decode node prefills it itself (routing_cost.py's local prefill: no hop, nothing shipped);
     otherwise, once the decode node's running step has ended (it reads its control messages
     between steps: the reservation's answer waits for it), after the prefill hop's own cost
     (overheads.handoff_s: PrefillRequest out,
     FirstToken back), the prefill node that finishes it soonest prefills it and ships the blocks not
     already on the decode node; the first token goes to the client, Commit to the decode node
"""
from __future__ import annotations

from collections import deque

from pdplan.decode_pool import DecodePool
from pdplan.events import EventLoop
from pdplan.prefill_pool import PrefillPool
from pdplan.sim_request import SimRequest
from router.config import ADMISSION_FIRST_WAIT_S, ADMISSION_MAX_WAIT_S, LOCAL_PREFILL_TOKENS

FIRST_WAIT_S, MAX_WAIT_S = ADMISSION_FIRST_WAIT_S, ADMISSION_MAX_WAIT_S     # the real router's


class SimRouter:
    def __init__(self, loop: EventLoop, prefill: PrefillPool, decode: DecodePool, request_s: float,
                 handoff_s: float = 0.0, local_prefill_tokens: int = LOCAL_PREFILL_TOKENS,
                 prompt_token_s: float = 0.0):
        self.loop, self.prefill, self.decode, self.request_s = loop, prefill, decode, request_s
        self.prompt_token_s = prompt_token_s
        self.handoff_s = handoff_s
        self.local_prefill_tokens = local_prefill_tokens
        self.local_prefills = 0
        self.pending: deque[SimRequest] = deque()
        self.waits = 0

    def arrive(self, req: SimRequest) -> None:
        self.loop.after(self.request_s + self.prompt_token_s * req.prompt_len, lambda: self._admit(req, FIRST_WAIT_S))

    def room(self) -> None:
        """A decode node freed blocks: the waiting requests try again, oldest first."""
        while self.pending:
            if not self._try(self.pending[0]):
                return
            self.pending.popleft()

    def _admit(self, req: SimRequest, wait_s: float, probe: bool = False) -> None:
        """probe: the request's timer fired (admission.py: ask the first ranked node anyway)."""
        if req in self.pending and self.pending[0] is not req:
            return                                  # FCFS: the oldest waiting one goes first
        if self._try(req, probe):
            if req in self.pending:
                self.pending.remove(req)
            return
        if req not in self.pending:
            self.pending.append(req)
            self.waits += 1
        self.loop.after(wait_s, lambda: req in self.pending and self._admit(req, min(2 * wait_s, MAX_WAIT_S), True))

    def _try(self, req: SimRequest, probe: bool = False) -> bool:
        got = self.decode.reserve(req, probe)
        if got is None:
            return False
        node, hits = got
        if req.prompt_len - hits * node.engine.bs <= self.local_prefill_tokens:
            self.local_prefills += 1
            node.engine.prefill_here(req.rid)
            return True
        node.engine.between_steps(lambda: self.loop.after(self.handoff_s, lambda: self.prefill.submit(
            req, hits, lambda t: req.token_times.append(t), lambda t: node.engine.adopt(req.rid))))
        return True
