"""A structured output's grammar, compiled on both nodes of an attempt before its decode node
reserves KV blocks (step 3b of router/cluster/admission.py's round):

    router ──CompileGrammar──▶ D and P at once: their compiles overlap (one compile's time to the
           ◀──GrammarReady | Busy | RequestFailed── each       first token, not two in a row)
    D's answer is judged first (its verdict is the grammar's: a compile past its time limit is a
    400 there), then P's, which is always awaited unless D failed the request:
      both ready       ─▶ DecodeRequest to D, which finds the grammar compiled and reserves at once;
                          P finds it compiled too when its PrefillRequest comes
      D Busy           ─▶ a Busy round (another D, or wait for room); P's compile goes on, cached
      P Busy           ─▶ Failure(busy) (its compiler's load: its time limit too): another
                          prefill node, or P once its retry hint passed (admission.py); a 503
                          only past the admission timeout
      RequestFailed    ─▶ Failure: a grammar that does not compile is a 400

No decode KV is held while either node compiles (it used to be: D reserved, then P compiled),
nor booked: the router books D and P only once both hold the grammar.
"""
from __future__ import annotations

from typing import Any

from pdwire.control import CompileGrammar, GrammarReady, RequestFailed
from pdwire.messages import Busy
from router.cluster.control_server import ControlServer
from router.cluster.disagg_request import Attempt, Failure, Lost
from router.cluster.registry import Node

ANSWERS = (GrammarReady, Busy, RequestFailed)


def needs_compile(att: Attempt) -> bool:
    """Whether the attempt's nodes compile its grammar before D reserves: a structured output with
    a prefill node (a local prefill or a KV move has no second compile: D parks it unreserved)."""
    return att.params.structured is not None and att.prefill is not None and not att.writer


async def compile_first(server: ControlServer, att: Attempt, decode: Node, deadline: float,
                        timeout_s: float) -> Busy | Failure | None:
    """CompileGrammar to D and P; None once both hold the grammar, D's Busy, or why the attempt
    fails. Raises NoNodeAvailable if they have not answered by `deadline` (loop time)."""
    att.decode_id = decode.node_id
    nodes = (decode.node_id, att.prefill_id)
    for node_id in nodes:
        att.contacted.add(node_id)
        server.send(node_id, CompileGrammar(att.wire_rid, att.params))
    answers: dict[str, Any] = {}
    while _waiting(answers, nodes):
        event = await att.next_event(deadline, lambda: f"{' and '.join(n for n in nodes if n not in answers)} did "
                                     f"not compile the request's grammar within the admission timeout of {timeout_s} s")
        if isinstance(event, Lost):     # (one of an earlier round's nodes: not this round's failure)
            if event.node_id in nodes:
                return event.failure()
            continue
        node_id, msg = event
        if node_id in nodes and isinstance(msg, ANSWERS):
            answers.setdefault(node_id, msg)
    return _verdict(att, answers[nodes[0]], answers.get(nodes[1]))


def _waiting(answers: dict[str, Any], nodes: tuple[str, str]) -> bool:
    """D has not answered, or P has not and D did not fail the request (P's answer is awaited
    after D's Busy, so no late answer of P's is taken for a later round's)."""
    decode, prefill = nodes
    return decode not in answers or (prefill not in answers and not isinstance(answers[decode], RequestFailed))


def _verdict(att: Attempt, decode: Any, prefill: Any) -> Busy | Failure | None:
    if isinstance(decode, RequestFailed):
        return Failure(att.decode_id, f"{att.decode_id}: {decode.reason}", decode.retryable)
    if isinstance(decode, Busy):
        att.contacted.discard(att.decode_id)
        att.decode_id = ""
        return decode
    if isinstance(prefill, RequestFailed):
        return Failure(att.prefill_id, f"{att.prefill_id}: {prefill.reason}", prefill.retryable)
    if isinstance(prefill, Busy):       # D only compiled: the next round picks D afresh
        att.decode_id = ""
        return Failure.prefill_busy(att.prefill_id, prefill)
    return None
