"""The control plane between the router and its nodes: every message, one codec.

Topology: the router binds one ZMQ ROUTER socket; each node connects a DEALER, proves that it
holds the cluster secret (kvtransport.session) and then names itself in its NodeHello. Every
message is sealed by that session (kvtransport.framing.control_framer): [msgpack `[version, kind, [fields...]]`, trailer], validated
on decode like the KV transport's own messages (pdwire.messages); Reserved and Busy are
shared with it.

  node   -> router: NodeHello (once per epoch), NodeStatus (heartbeat), NodeGoodbye (on exit),
                    KVEvents (block hashes the node's prefix cache stored and evicted),
                    FirstToken (prefill),
                    TokenDelta (decode), Reserved | Busy (decode, answering DecodeRequest),
                    Paused (decode, answering PauseRequest), GrammarReady | Busy (answering
                    CompileGrammar), RequestFailed
  router -> node:   NodeCommand (answer to hello/heartbeat), CompileGrammar (both nodes of a
                    structured output's attempt, before DecodeRequest), DecodeRequest,
                    PrefillRequest, AbortRequest, PauseRequest and ShipRequest (decode: a KV move, below)

A KV move takes a running request from decode node D1 to D2 with its blocks (an operator's
remove or drain deadline): PauseRequest(rid) ─▶ D1 stops it and keeps its blocks ─▶ Paused;
DecodeRequest(prompt + the tokens before D1's last, writer D1) ─▶ D2 ─▶ Reserved;
ShipRequest ─▶ D1 ships into D2's reservation and commits its last token as the first.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgpack

from pdwire import messages
from pdwire.figures import KV_COUNTERS, PREFIX_COUNTERS, NodeFigures, PrefixCounters, TransferCounters
from pdwire.messages import Busy, Reserved
from pdwire.sampling_params import SamplingParams
from pdwire.schema import (MAX_BLOCKS, MAX_RID_LEN, MAX_TOKEN_ID, PROTOCOL_VERSION, ProtocolError,
                                check_bool, check_hashes, check_id, check_int, check_ints, check_seq, check_str)

MAX_PROMPT_TOKENS = 1 << 20
MAX_CONTROL_BYTES = 16 << 20
MAX_KV_EVENT_HASHES = 1 << 16   # hashes per KVEvents message (~1.2 MB): a snapshot goes in several
ROLES = ("prefill", "decode")
COMMANDS = ("ok", "register", "drain", "leave")
_FLOAT_LIMIT = 1e6


def _rid(value: Any) -> str:
    return check_str(value, "rid", max_len=MAX_RID_LEN, min_len=1)


def _float(value: Any, name: str, lo: float = 0.0, hi: float = _FLOAT_LIMIT) -> float:
    if type(value) not in (int, float) or not lo <= value <= hi:
        raise ProtocolError(f"{name} must be a number in [{lo}, {hi}]")
    return float(value)


def _tokens(value: Any, name: str, max_len: int = MAX_PROMPT_TOKENS) -> tuple[int, ...]:
    return check_ints(value, name, max_len, hi=MAX_TOKEN_ID)


def _logprobs(value: Any) -> tuple | None:
    """None, or per token a list of [token_id, logprob] pairs."""
    if value is None:
        return None
    for entry in check_seq(value, "logprobs", MAX_PROMPT_TOKENS):
        for pair in check_seq(entry, "logprobs entry", 64):
            if type(pair) not in (list, tuple) or len(pair) != 2:
                raise ProtocolError("a logprob is a [token_id, logprob] pair")
            check_int(pair[0], "logprob token", hi=MAX_TOKEN_ID)
            _float(pair[1], "logprob", lo=-1e30, hi=0.0)
    return tuple(value)


def params_to_wire(params: SamplingParams) -> dict:
    """A map of field names; `structured` only when set, so a peer without it still decodes
    every request that does not use it (and refuses, as an unknown field, one that does)."""
    wire = {f.name: (list(v) if isinstance(v := getattr(params, f.name), tuple) else v)
            for f in fields(params) if f.name != "structured"}
    if params.structured is not None:
        wire["structured"] = params.structured.to_wire()
    return wire


def params_from_wire(value: Any) -> SamplingParams:
    if type(value) is not dict:
        raise ProtocolError("params must be a map")
    known = {f.name for f in fields(SamplingParams)}
    if not set(value) <= known:
        raise ProtocolError(f"unknown sampling fields {sorted(set(value) - known)}")
    try:
        return SamplingParams(**value)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad params: {e}") from None


@dataclass(frozen=True, slots=True)
class NodeHello:
    node_id: str
    epoch: str
    role: str                    # "prefill" | "decode"
    kv_endpoint: str             # decode: where prefill nodes ship blocks; prefill: ""
    num_blocks: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        check_id(self.node_id, "node_id"), check_id(self.epoch, "epoch")
        if self.role not in ROLES:
            raise ProtocolError(f"role must be one of {ROLES}")
        check_str(self.kv_endpoint, "kv_endpoint", max_len=256)
        check_int(self.num_blocks, "num_blocks", 1, MAX_BLOCKS * 64)
        check_int(self.block_size, "block_size", 1, 1024)
        check_int(self.max_model_len, "max_model_len", 1, MAX_PROMPT_TOKENS)


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: str
    epoch: str
    num_running: int
    num_waiting: int
    kv_usage: float              # 0..1
    prefix_hit_rate: float       # 0..1
    num_preemptions: int
    num_free_blocks: int
    # KV transfer counters since the node started (a prefill node sends, a decode node receives)
    kv_blocks_sent: int = 0
    kv_bytes_sent: int = 0
    kv_blocks_received: int = 0
    kv_bytes_received: int = 0
    kv_transfers_done: int = 0       # committed: sent (P) or adopted-ready (D)
    kv_transfers_failed: int = 0
    kv_frames_dropped: int = 0       # malformed or hostile frames a decode node (or replies a prefill node) dropped
    # prefix-cache totals since the node started, in prompt tokens (optional: older peers send none)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0       # <= prefix_queried_tokens

    def __post_init__(self) -> None:
        check_id(self.node_id, "node_id"), check_id(self.epoch, "epoch")
        for name in ("num_running", "num_waiting", "num_preemptions", "num_free_blocks", *KV_COUNTERS,
                     *PREFIX_COUNTERS):
            check_int(getattr(self, name), name)
        check_int(self.prefix_hit_tokens, "prefix_hit_tokens", hi=self.prefix_queried_tokens)
        _float(self.kv_usage, "kv_usage", hi=1.0), _float(self.prefix_hit_rate, "prefix_hit_rate", hi=1.0)

    @classmethod
    def of(cls, node_id: str, epoch: str, figures: NodeFigures) -> NodeStatus:
        """The heartbeat carrying `figures` (flat on the wire, as peers before the record expect)."""
        return cls(node_id, epoch, *figures[:-2], *figures.transfer, *figures.prefix)

    @property
    def transfer(self) -> TransferCounters:
        return TransferCounters(*(getattr(self, name) for name in KV_COUNTERS))

    @property
    def prefix(self) -> PrefixCounters:
        return PrefixCounters(self.prefix_queried_tokens, self.prefix_hit_tokens)

    @property
    def figures(self) -> NodeFigures:
        return NodeFigures(self.num_running, self.num_waiting, self.kv_usage, self.prefix_hit_rate,
                           self.num_preemptions, self.num_free_blocks, self.transfer, self.prefix)


@dataclass(frozen=True, slots=True)
class NodeGoodbye:
    """Node -> router on every clean exit: its requests are moved at once, not after a timeout."""
    node_id: str
    epoch: str
    reason: str

    def __post_init__(self) -> None:
        check_id(self.node_id, "node_id"), check_id(self.epoch, "epoch"), check_str(self.reason, "reason")


@dataclass(frozen=True, slots=True)
class KVEvents:
    """Node -> router: chained block hashes its prefix cache stored and evicted since the last
    KVEvents, in that order (a hash stored and evicted in one batch is in both). `reset` starts a
    snapshot: the router drops what it knew of this node's cache first; a snapshot longer than
    MAX_KV_EVENT_HASHES continues in messages without `reset`."""
    node_id: str
    epoch: str
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    reset: bool = False

    def __post_init__(self) -> None:
        check_id(self.node_id, "node_id"), check_id(self.epoch, "epoch"), check_bool(self.reset, "reset")
        object.__setattr__(self, "stored", check_hashes(self.stored, "stored", MAX_KV_EVENT_HASHES))
        object.__setattr__(self, "removed", check_hashes(self.removed, "removed", MAX_KV_EVENT_HASHES))


@dataclass(frozen=True, slots=True)
class NodeCommand:
    command: str                 # ok | register (unknown epoch: say hello again) | drain | leave

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise ProtocolError(f"command must be one of {COMMANDS}")


@dataclass(frozen=True, slots=True)
class CompileGrammar:
    """Router -> prefill and decode node: compile this request's grammar now (answered by
    GrammarReady once compiled, Busy, or RequestFailed for a grammar that does not compile), so
    that both compile it at once and neither holds a reservation while it does."""
    rid: str
    params: SamplingParams       # its structured output is the grammar

    def __post_init__(self) -> None:
        _rid(self.rid)
        if not isinstance(self.params, SamplingParams):
            object.__setattr__(self, "params", params_from_wire(self.params))
        if self.params.structured is None:
            raise ProtocolError("CompileGrammar without a structured output")


@dataclass(frozen=True, slots=True)
class GrammarReady:
    """Node -> router: the request's grammar is compiled here (CompileGrammar's answer)."""
    rid: str

    def __post_init__(self) -> None:
        _rid(self.rid)


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Router -> decode node: reserve blocks for this prompt (answered by Reserved or Busy)."""
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prefill_node_id: str         # the only node allowed to write the reservation
    prior_outputs: int = 0       # the prompt's last tokens that an earlier attempt generated
    local_prefill: bool = False  # the decode node computes the prompt's uncached tail itself and
                                 # samples the first token (no prefill node; older peers: False)

    def __post_init__(self) -> None:
        _rid(self.rid), check_id(self.prefill_node_id, "prefill_node_id")
        check_bool(self.local_prefill, "local_prefill")
        _check_prompt_request(self)


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """Router -> prefill node: compute the prompt, ship its blocks into D's reservation."""
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    kv_endpoint: str             # the decode node's KV receiver
    xfer_id: str
    dst_block_ids: tuple[int, ...]
    cached_prefix_blocks: int
    prior_outputs: int = 0       # as DecodeRequest's

    def __post_init__(self) -> None:
        _rid(self.rid), check_str(self.kv_endpoint, "kv_endpoint", max_len=256, min_len=1)
        check_id(self.xfer_id, "xfer_id")
        object.__setattr__(self, "dst_block_ids", check_ints(self.dst_block_ids, "dst_block_ids", MAX_BLOCKS))
        check_int(self.cached_prefix_blocks, "cached_prefix_blocks", hi=len(self.dst_block_ids))
        _check_prompt_request(self)


def _check_prompt_request(msg: DecodeRequest | PrefillRequest) -> None:
    """The fields a DecodeRequest and a PrefillRequest share: a non-empty prompt, prior outputs
    inside it, sampling params (decoded from the wire's map if need be)."""
    object.__setattr__(msg, "prompt_ids", _tokens(msg.prompt_ids, "prompt_ids"))
    if not msg.prompt_ids:
        raise ProtocolError("prompt_ids is empty")
    check_int(msg.prior_outputs, "prior_outputs", hi=len(msg.prompt_ids) - 1)
    if not isinstance(msg.params, SamplingParams):
        object.__setattr__(msg, "params", params_from_wire(msg.params))


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill node -> router, as soon as the first token is sampled (TTFT)."""
    rid: str
    token_id: int
    text: str
    logprobs: tuple | None       # [[token_id, logprob], ...] for this token, or None
    finish_reason: str           # "" unless the first token already ends the request
    prompt_logprobs: tuple | None = None    # per prompt token such a list, or None (the first)

    def __post_init__(self) -> None:
        _rid(self.rid), check_int(self.token_id, "token_id", hi=MAX_TOKEN_ID)
        check_str(self.text, "text", max_len=1 << 16), check_str(self.finish_reason, "finish_reason", 16)
        if self.logprobs is not None:
            _logprobs([self.logprobs])
        if self.prompt_logprobs is not None:
            entries = check_seq(self.prompt_logprobs, "prompt_logprobs", MAX_PROMPT_TOKENS)
            _logprobs([e for e in entries if e is not None])


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Decode node -> router: tokens [index, index + len(token_ids)) and the text they add."""
    rid: str
    index: int                   # position of token_ids[0] among the generated tokens
    token_ids: tuple[int, ...]
    text_offset: int             # characters of output text before `text`
    text: str
    logprobs: tuple | None       # one entry per token of token_ids (may be shorter: first token)
    finish_reason: str           # "" while running; stop | length | abort

    def __post_init__(self) -> None:
        _rid(self.rid), check_int(self.index, "index"), check_int(self.text_offset, "text_offset")
        object.__setattr__(self, "token_ids", _tokens(self.token_ids, "token_ids"))
        check_str(self.text, "text", max_len=1 << 20), check_str(self.finish_reason, "finish_reason", 16)
        _logprobs(self.logprobs)


# A prefill node's RequestFailed whose reason starts so blames its transfer to the decode node: the
# router's next attempt avoids that decode node (the prefill node may take it again)
TRANSFER_FAILED, UNREACHABLE_DECODE = "transfer failed", "cannot reach decode node"


@dataclass(frozen=True, slots=True)
class RequestFailed:
    rid: str
    reason: str
    retryable: bool              # the router may run it again elsewhere

    def __post_init__(self) -> None:
        _rid(self.rid), check_str(self.reason, "reason"), check_bool(self.retryable, "retryable")


@dataclass(frozen=True, slots=True)
class PauseRequest:
    """Router -> decode node: stop decoding rid and keep its blocks for a ShipRequest (a KV move)."""
    rid: str

    def __post_init__(self) -> None:
        _rid(self.rid)


@dataclass(frozen=True, slots=True)
class Paused:
    """Decode node -> router, after every TokenDelta of rid: rid stopped after num_tokens generated
    tokens here, the K/V of all but the last one held. num_tokens = 0: nothing is held (rid was
    not decoding here: still arriving, preempted, finished or unknown); it is dropped here."""
    rid: str
    num_tokens: int              # tokens this node generated for rid (all sent in TokenDeltas)
    text_chars: int              # characters of its output text before the last token's

    def __post_init__(self) -> None:
        _rid(self.rid), check_int(self.num_tokens, "num_tokens", hi=MAX_PROMPT_TOKENS)
        check_int(self.text_chars, "text_chars", hi=MAX_PROMPT_TOKENS * 64)


@dataclass(frozen=True, slots=True)
class ShipRequest:
    """Router -> the decode node holding from_rid: ship its blocks into the reservation a decode
    node made for attempt rid (whose writer is this node), then Commit its last token as the first
    token of num_tokens; the held blocks are then freed here."""
    rid: str                     # the new attempt, on the receiving decode node
    from_rid: str                # the paused request here
    kv_endpoint: str             # the receiving decode node's KV receiver
    xfer_id: str
    dst_block_ids: tuple[int, ...]
    cached_prefix_blocks: int

    def __post_init__(self) -> None:
        _rid(self.rid), _rid(self.from_rid), check_id(self.xfer_id, "xfer_id")
        check_str(self.kv_endpoint, "kv_endpoint", max_len=256, min_len=1)
        object.__setattr__(self, "dst_block_ids", check_ints(self.dst_block_ids, "dst_block_ids", MAX_BLOCKS))
        if not self.dst_block_ids:
            raise ProtocolError("dst_block_ids is empty")
        check_int(self.cached_prefix_blocks, "cached_prefix_blocks", hi=len(self.dst_block_ids))


@dataclass(frozen=True, slots=True)
class AbortRequest:
    rid: str

    def __post_init__(self) -> None:
        _rid(self.rid)


KINDS: dict[str, type] = {
    "node_hello": NodeHello, "node_status": NodeStatus, "node_goodbye": NodeGoodbye, "node_command": NodeCommand,
    "kv_events": KVEvents,
    "decode_request": DecodeRequest, "prefill_request": PrefillRequest, "first_token": FirstToken,
    "token_delta": TokenDelta, "request_failed": RequestFailed, "abort_request": AbortRequest,
    "reserved": Reserved, "busy": Busy,
    "pause_request": PauseRequest, "paused": Paused, "ship_request": ShipRequest,
    "compile_grammar": CompileGrammar, "grammar_ready": GrammarReady,
}
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}


def encode(msg: Any) -> bytes:
    values = [params_to_wire(v) if isinstance(v := getattr(msg, f.name), SamplingParams) else v
              for f in fields(msg)]
    return msgpack.packb([PROTOCOL_VERSION, _KIND_OF[type(msg)], values], use_bin_type=True)


def decode(buf: bytes | memoryview) -> Any:
    """The message in buf; raises ProtocolError (only) for anything that is not one."""
    return messages.decode(buf, KINDS, MAX_CONTROL_BYTES)
