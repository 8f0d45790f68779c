"""The router <-> node control plane: every message round-trips; anything else is ProtocolError."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from engine import SamplingParams
from pdwire import control
from pdwire.figures import PrefixCounters
from pdwire.kv_endpoint import kv_endpoint_problem
from pdwire.control import (AbortRequest, CompileGrammar, DecodeRequest, FirstToken, GrammarReady, NodeCommand,
                            NodeHello, NodeStatus, Paused, PauseRequest, PrefillRequest, RequestFailed, ShipRequest,
                            TokenDelta)
from pdwire.structured_output import GrammarKind, StructuredOutput
from pdwire.schema import ProtocolError

PARAMS = SamplingParams(temperature=0.7, top_k=5, stop=("\n\n",), seed=3, max_tokens=9, logprobs=2)
MESSAGES = [
    NodeHello("decode-0", "abc123", "decode", "tcp://127.0.0.1:5555", 128, 16, 2048),
    NodeStatus("prefill-0", "e1", 3, 1, 0.5, 0.25, 2, 64), NodeCommand("drain"),
    NodeStatus("decode-0", "e1", 3, 1, 0.5, 0.25, 2, 64, 0, 0, 12, 3 << 33, 4, 1, 7),
    DecodeRequest("r1", (1, 2, 3), PARAMS, "prefill-0"),
    PrefillRequest("r1", (1, 2, 3), PARAMS, "tcp://127.0.0.1:5555", "x.1", (4, 5), 1),
    DecodeRequest("r1~1", (1, 2, 3, 9), PARAMS, "prefill-0", 3),
    PrefillRequest("r1~1", (1, 2, 3, 9), PARAMS, "tcp://127.0.0.1:5555", "x.2", (4, 5), 0, 3),
    FirstToken("r1", 42, "hi", ((42, -0.1), (7, -2.5)), ""),
    FirstToken("r1", 42, "hi", None, "", (None, ((2, -0.5), (9, -1.0)), ((3, -0.25),))),
    TokenDelta("r1", 1, (5, 6), 2, " there", ((), ((6, -0.3),)), "length"),
    RequestFailed("r1", "busy", True), AbortRequest("r1"),
    PauseRequest("r1"), Paused("r1", 7, 12), Paused("r1", 0, 0),
    ShipRequest("r1~1", "r1", "tcp://127.0.0.1:5556", "x.3", (8, 9, 10), 1),
    CompileGrammar("r1", SamplingParams(max_tokens=9, structured=StructuredOutput(GrammarKind.REGEX, "[ab]+"))),
    GrammarReady("r1"),
]


def test_a_compile_grammar_without_a_grammar_is_refused():
    """CompileGrammar carries a structured output, or it is a ProtocolError (nothing to compile)."""
    values = msgpack.unpackb(control.encode(CompileGrammar("r1", SamplingParams(structured=StructuredOutput(
        GrammarKind.REGEX, "a")))))[2]
    values[1].pop("structured")
    with pytest.raises(ProtocolError, match="structured output"):
        control.decode(msgpack.packb([control.PROTOCOL_VERSION, "compile_grammar", values]))


def test_a_status_without_the_newer_counters_still_decodes():
    """A node from before the KV counters sends 8 fields: they read as 0; fewer than 8 is refused."""
    envelope = lambda values: msgpack.packb([control.PROTOCOL_VERSION, "node_status", values])
    old = control.decode(envelope(["prefill-0", "e1", 3, 1, 0.5, 0.25, 2, 64]))
    assert isinstance(old, NodeStatus) and old.kv_bytes_sent == old.kv_frames_dropped == 0
    for values in (["prefill-0", "e1", 3, 1, 0.5, 0.25, 2], ["prefill-0", "e1", 3, 1, 0.5, 0.25, 2, 64] + [0] * 10,
                   ["prefill-0", "e1", 3, 1, 0.5, 0.25, 2, 64, -1]):
        with pytest.raises(ProtocolError):
            control.decode(envelope(values))


def test_a_decode_request_without_local_prefill_still_decodes():
    """A router from before local prefill sends DecodeRequest without its last field: it reads as
    False (a prefill node ships the prompt); one field more than this node knows is refused."""
    envelope = lambda values: msgpack.packb([control.PROTOCOL_VERSION, "decode_request", values])
    wire = control.encode(DecodeRequest("r1", (1, 2, 3), PARAMS, "prefill-0", 0, True))
    values = msgpack.unpackb(wire)[2]
    old = control.decode(envelope(values[:-1]))
    assert isinstance(old, DecodeRequest) and old.local_prefill is False and old.prompt_ids == (1, 2, 3)
    assert control.decode(envelope(values)).local_prefill is True
    with pytest.raises(ProtocolError):
        control.decode(envelope(values + [False]))


def test_a_status_without_the_prefix_counters_still_decodes():
    """A node from before the prefix-cache counters sends 15 fields: they read as 0; hits above queries are refused."""
    envelope = lambda values: msgpack.packb([control.PROTOCOL_VERSION, "node_status", values])
    head = ["decode-0", "e1", 3, 1, 0.5, 0.25, 2, 64, 0, 0, 12, 4096, 4, 1, 7]
    old = control.decode(envelope(head))
    assert old.prefix == PrefixCounters(0, 0) and old.kv_frames_dropped == 7
    assert control.decode(envelope(head + [96, 32])).figures.prefix == PrefixCounters(96, 32)
    with pytest.raises(ProtocolError):
        control.decode(envelope(head + [32, 96]))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    """encode then decode gives back an equal message (sampling parameters included)."""
    back = control.decode(control.encode(msg))
    assert type(back) is type(msg)
    assert control.encode(back) == control.encode(msg)


@pytest.mark.parametrize("kind, values", [
    ("paused", ["r1", -1, 0]), ("paused", ["r1", 3, "12"]), ("paused", ["", 3, 1]),
    ("pause_request", ["r" * 1000]),
    ("ship_request", ["r1~1", "r1", "tcp://h:1", "x.3", [], 0]),              # no block
    ("ship_request", ["r1~1", "r1", "tcp://h:1", "x.3", [8, 9], 3]),          # more cached than blocks
    ("ship_request", ["r1~1", "r1", "tcp://h:1", "x.3", [8, -9], 0]),
    ("ship_request", ["r1~1", "r1", "", "x.3", [8], 0]),
    ("ship_request", ["r1~1", "r1", "tcp://h:1", "x y", [8], 0]),            # not an id
])
def test_bad_kv_move_fields_are_protocol_errors(kind, values):
    """A KV move's messages are checked like every other: rids, counts, endpoint, ids, block lists."""
    with pytest.raises(ProtocolError):
        control.decode(msgpack.packb([control.PROTOCOL_VERSION, kind, values]))


@pytest.mark.parametrize("fields", [
    ["d", "e", "decode", "x", 0, 16, 10],                       # num_blocks 0
    ["d", "e", "mystery", "x", 1, 16, 10],                      # unknown role
    ["d", "e", "decode", "x", True, 16, 10],                    # a bool is not an int
])
def test_bad_hello_fields_are_protocol_errors(fields):
    """Out-of-range or mistyped fields are refused with ProtocolError naming the problem."""
    with pytest.raises(ProtocolError):
        control.decode(msgpack.packb([1, "node_hello", fields]))


def test_hostile_sampling_params_are_refused():
    """Unknown or out-of-range sampling fields in a request are ProtocolErrors, not crashes."""
    for params in ({"temperature": -1.0}, {"evil": 1}, {"stop": 5}, "greedy"):
        with pytest.raises(ProtocolError):
            control.decode(msgpack.packb([1, "decode_request", ["r", [1], params, "p0"]]))


def test_bad_prompt_logprobs_are_protocol_errors():
    """A first token's prompt logprobs are None or per-token lists of [token_id, logprob <= 0]."""
    for bad in ("x", [[[1, 0.5]]], [[[1]]], [[1, -0.5]], [[["a", -0.5]]]):
        with pytest.raises(ProtocolError):
            control.decode(msgpack.packb([1, "first_token", ["r", 1, "t", None, "", bad]]))


def test_prior_outputs_must_leave_a_prompt_token():
    """A moved request's prior_outputs counts prompt tokens: it may not be negative, a bool, or
    cover the whole prompt; without it (an older router) it reads as 0."""
    assert control.decode(msgpack.packb([1, "decode_request", ["r", [1, 2], {}, "p0"]])).prior_outputs == 0
    for prior in (-1, 2, 3, True, 1.0):
        with pytest.raises(ProtocolError):
            control.decode(msgpack.packb([1, "decode_request", ["r", [1, 2], {}, "p0", prior]]))
        with pytest.raises(ProtocolError):
            control.decode(msgpack.packb([1, "prefill_request", ["r", [1, 2], {}, "tcp://h:1", "x", [4], 0, prior]]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_protocol_error(data):
    """Random bytes never make the decoder raise anything but ProtocolError."""
    try:
        control.decode(data)
    except ProtocolError:
        pass


def test_node_status_carries_figures_flat_and_back():
    """NodeStatus.of(figures) is the same flat wire message as before, and .figures gives the record back."""
    from pdwire.figures import NodeFigures, TransferCounters
    figures = NodeFigures(2, 1, 0.5, 0.25, 3, 7, TransferCounters(blocks_received=4, bytes_received=64,
                                                                 transfers_done=1, frames_dropped=2),
                          PrefixCounters(48, 16))
    status = NodeStatus.of("n1", "e1", figures)
    assert status == NodeStatus("n1", "e1", 2, 1, 0.5, 0.25, 3, 7, 0, 0, 4, 64, 1, 0, 2, 48, 16)
    assert control.decode(control.encode(status)).figures == figures


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://decode-0.kv.test:7000", "tcp://[::1]:5",
                                      "ipc:///tmp/kv-d0"])
def test_kv_endpoints_of_every_form_a_receiver_binds_are_usable(endpoint):
    """A tcp endpoint with a DNS name, an IPv4 or a bracketed IPv6 host, or an ipc path, passes."""
    assert kv_endpoint_problem(endpoint) == ""
