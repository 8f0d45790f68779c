"""Wire schema: every message round-trips through msgpack; anything else is a ProtocolError."""
import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from kvtransport.framing import Framer, FrameError
from kvtransport.session import TRAILER_LEN, Session
from pdwire.handshake import KVLayout, PeerIdentity
from pdwire.messages import (KINDS, MAX_BATCH_BLOCKS, OLD_ACK_BATCH_BYTES, Abort, BlockBatch, BlockFrame, Busy, Commit,
                             Heartbeat, Hello, HelloAck, LayerBatch, P2PJoin, Reserve, Reserved, decode, encode)
from kvtransport.metrics import DropReason
from pdwire.schema import PROTOCOL_VERSION, ProtocolError

LAYOUT = KVLayout("0123abcd", "bfloat16", 16, 8, 8, 64)
IDENT = PeerIdentity("prefill-0", "a1b2c3d4e5f60718", "zmq", LAYOUT)

EXAMPLES = [
    Hello(IDENT),
    HelloAck(IDENT, True),
    HelloAck(IDENT, False, "handshake refused: block_size differs"),
    HelloAck(IDENT, True, "", 16 << 20, True),
    P2PJoin("prefill-0/a1b2", "127.0.0.1", 29500),
    BlockFrame("d0-1f-7", 3, 41, 1 << 20, "float32", (8, 2, 16, 8, 64)),
    BlockBatch("d0-1f-7", (4, 5, 6, 9), (40, 12, 13, 7), 1 << 20, "float32", (8, 2, 16, 8, 64)),
    LayerBatch("d0-1f-7", (4, 5), (40, 12), 6, 256 << 10, "float32", (2, 2, 16, 8, 64)),
    Commit("d0-1f-7", 128000, 77),
    Abort("d0-1f-7", "lease expired"),
    Heartbeat("a1b2c3d4e5f60718", ("d0-1f-7", "d0-1f-8")),
    Reserve("req-" + "x" * 124, 40, (b"\x00" * 16, b"\xff" * 16), 256),
    Reserved("req-1", "d0-1f-7", (4, 9, 2), 1),
    Reserved("req-1", "d0-1f-7", (4, 9, 2), 1, 3),          # the cached block was used by no request
    Busy("req-1", "no free blocks", 50),
    HelloAck(IDENT, True, "", 16 << 20, True, True),     # a receiver that reads the seal first
]


def test_every_kind_has_an_example():
    """Every registered message kind is covered by the round-trip test."""
    assert {type(m) for m in EXAMPLES} == set(KINDS.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    """decode(encode(m)) == m for every message kind."""
    assert decode(encode(msg)) == msg


def _envelope(kind, fields, version=PROTOCOL_VERSION):
    return msgpack.packb([version, kind, fields], use_bin_type=True)


def _block_fields(**over):
    f = dict(xfer_id="x1", index=0, block_id=3, nbytes=64, dtype="float32", shape=[2, 2, 4])
    f.update(over)
    return list(f.values())


def _batch_fields(**over):
    f = dict(xfer_id="x1", indices=[0, 1], block_ids=[3, 4], nbytes=64, dtype="float32", shape=[2, 2, 4])
    f.update(over)
    return list(f.values())


@pytest.mark.parametrize("buf", [
    b"", b"\xc1", b"\x93\x01", msgpack.packb({"k": 1}), msgpack.packb([1, "block"]),
    _envelope("block", _block_fields(), version=2),          # other protocol version
    _envelope("block", _block_fields(), version=True),       # bool is not an int
    _envelope("teleport", []),                               # unknown kind
    _envelope("block", _block_fields()[:-1]),                # missing field
    _envelope("block", _block_fields(index=-1)),             # negative index
    _envelope("block", _block_fields(block_id=True)),        # bool as int
    _envelope("block", _block_fields(block_id=2**31)),       # block id out of range
    _envelope("block", _block_fields(dtype="complex64")),    # not a KV dtype
    _envelope("block", _block_fields(shape=[2, 0])),         # zero dim
    _envelope("block", _block_fields(shape="2x2")),          # wrong type
    _envelope("block", _block_fields(xfer_id="")),           # empty id
    _envelope("block", _block_fields(xfer_id="x\n1")),       # control character in id
    _envelope("blocks", _batch_fields()[:-1]),               # missing field
    _envelope("blocks", _batch_fields(indices=[0, 0])),      # an index twice
    _envelope("blocks", _batch_fields(block_ids=[3, 3])),    # a block twice
    _envelope("blocks", _batch_fields(block_ids=[3])),       # fewer blocks than indices
    _envelope("blocks", _batch_fields(indices=[], block_ids=[])),            # no block
    _envelope("blocks", _batch_fields(indices=list(range(MAX_BATCH_BLOCKS + 1)),
                                      block_ids=list(range(MAX_BATCH_BLOCKS + 1)))),   # too many
    _envelope("commit", ["x1", -5, 10]),                     # negative token
    _envelope("reserve", ["r" * 129, 10, [], 5]),            # rid over 128 chars
    _envelope("reserve", ["r", 10, [b"\x00" * 15], 5]),      # hash of 15 bytes
    _envelope("reserved", ["r", "x", [1, 2], 3]),            # cached prefix > blocks
    _envelope("reserved", ["r", "x", [1, 2], 1, 0]),         # took fewer blocks than its uncached ones
    _envelope("reserved", ["r", "x", [1, 2], 0, 3]),         # took more blocks than its table
    _envelope("reserved", ["r", "x", [1, 2], 0, True]),      # bool as int
    _envelope("hello", [["n", "e", "zmq", ["m", "float32", 16, 1, 1]]]),  # short layout
    _envelope("hello", [[1, 2, 3, 4]]),                       # identity of wrong types
    _envelope("layers", ["x1", [0, 1], [3, 3], 0, 64, "float32", [1, 2, 4]]),   # a block twice
    _envelope("layers", ["x1", [0], [3], -1, 64, "float32", [1, 2, 4]]),         # negative first layer
    _envelope("layers", ["x1", [0], [3], 0, 64, "float32", [0, 2, 4]]),          # no layer
    _envelope("hello_ack", [IDENT.to_wire(), True, "", 4 << 20, 1]),   # layer_slices must be a bool
    _envelope("hello_ack", [IDENT.to_wire(), True, "", 0]),         # a receiver taking no batch bytes
    _envelope("hello_ack", [IDENT.to_wire(), True, "", (256 << 20) + 1]),   # over BATCH_BYTES_LIMIT
    _envelope("heartbeat", ["e", [1, 2]]),                   # ids must be strings
    msgpack.packb([1, "abort", ["x", msgpack.ExtType(5, b"z")]], use_bin_type=True),
])
def test_malformed_is_protocol_error(buf):
    """Malformed or out-of-range input raises ProtocolError, never anything else."""
    with pytest.raises(ProtocolError):
        decode(buf)


def test_hello_ack_from_before_max_batch_bytes_takes_the_old_cap():
    """A HelloAck without max_batch_bytes (a receiver from before it) means OLD_ACK_BATCH_BYTES."""
    ack = decode(_envelope("hello_ack", [IDENT.to_wire(), True, ""]))
    assert ack == HelloAck(IDENT, True) and ack.max_batch_bytes == OLD_ACK_BATCH_BYTES == 4 << 20
    assert not ack.sealed_first            # nor the seal: a sender puts payloads first


def test_reserved_from_before_taken_blocks_reports_none():
    """A Reserved without taken_blocks (a decode node from before it) decodes with None."""
    msg = decode(_envelope("reserved", ["r", "x", [1, 2], 1]))
    assert msg == Reserved("r", "x", (1, 2), 1) and msg.taken_blocks is None


def test_constructing_an_invalid_message_raises():
    """A message that exists is valid: the constructor runs the same checks as decode."""
    with pytest.raises(ProtocolError):
        Commit("x1", 1, 0)
    with pytest.raises(ProtocolError):
        Reserve("r", 10, (b"short",), 1)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(buf):
    """Random bytes never crash the decoder with anything but ProtocolError."""
    try:
        decode(buf)
    except ProtocolError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                  st.text(max_size=20), st.binary(max_size=20))
_tree = st.recursive(
    _leaf, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=15)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(KINDS)), st.lists(_tree, max_size=7))
def test_fuzz_well_formed_envelopes(kind, fields):
    """Valid msgpack with a known kind and random fields decodes or raises ProtocolError."""
    try:
        decode(_envelope(kind, fields))
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EXAMPLES), st.integers(0, 10_000), st.integers(0, 255))
def test_fuzz_mutated_messages(msg, pos, byte):
    """A valid message with one byte changed decodes or raises ProtocolError."""
    buf = bytearray(encode(msg))
    buf[pos % len(buf)] = byte
    try:
        decode(bytes(buf))
    except ProtocolError:
        pass


def test_sealed_round_trip_and_rejects_wrong_or_missing_mac():
    """Only frames sealed by the peer's session unpack; another key, no trailer, a changed header,
    a changed payload length or an extra frame drop as BAD_MAC; too many frames is MALFORMED."""
    ours, theirs = session_pair()
    stranger, _ = session_pair(b"t" * 32)
    framer, msg, payload = Framer(), EXAMPLES[4], bytes(range(256)) * 4
    frames = framer.pack(ours, msg, payload)
    assert len(frames) == 3 and len(frames[-1]) == TRAILER_LEN
    got = framer.unpack(theirs, frames)
    assert got.msg == msg and bytes(got.payload) == payload
    header = bytearray(frames[0])
    header[-1] ^= 1
    for bad in (framer.pack(stranger, msg, payload), frames[:2], [bytes(header), payload, frames[2]],
                [frames[0], payload[:-1], frames[2]], [frames[0], payload, payload, frames[2]],
                [frames[0], payload[:500], payload[500:], frames[2]]):
        with pytest.raises(FrameError) as e:
            framer.unpack(theirs, bad)
        assert e.value.reason is DropReason.BAD_MAC
    with pytest.raises(FrameError) as e:
        framer.unpack(theirs, [frames[0], *[b"x"] * (MAX_BATCH_BLOCKS + 1), frames[2]])
    assert e.value.reason is DropReason.MALFORMED


def test_several_payloads_round_trip_and_their_lengths_are_sealed():
    """A BlockBatch's payload frames unpack in order; moving bytes between them breaks the MAC."""
    ours, theirs = session_pair()
    framer, msg = Framer(), EXAMPLES[5]
    payloads = [b"a" * 300, b"b" * 100]
    frames = framer.pack_many(ours, msg, payloads)
    got = framer.unpack(theirs, frames)
    assert got.msg == msg and [bytes(p) for p in got.payloads] == payloads and got.payload is None
    ours, theirs = session_pair()
    frames = framer.pack_many(ours, msg, payloads)
    with pytest.raises(FrameError) as e:
        framer.unpack(theirs, [frames[0], b"a" * 200, b"a" * 100 + b"b" * 100, frames[-1]])
    assert e.value.reason is DropReason.BAD_MAC


def test_oversize_payload_is_rejected():
    """Payloads above the framer's cap, alone or together, in either order, are dropped as
    OVERSIZE; at the cap they unpack."""
    framer, (ours, theirs) = Framer(max_payload_bytes=64), session_pair()
    for sealed_first in (False, True):
        for payloads in ([b"\x00" * 65], [b"\x00" * 40, b"\x00" * 25], [b"\x00" * 48, b"\x00" * 17]):
            with pytest.raises(FrameError) as e:
                framer.unpack(theirs, framer.pack_many(ours, EXAMPLES[4], payloads, sealed_first))
            assert e.value.reason is DropReason.OVERSIZE
        got = framer.unpack(theirs, framer.pack_many(ours, EXAMPLES[5], [b"a" * 48, b"b" * 16], sealed_first))
        assert [bytes(p) for p in got.payloads] == [b"a" * 48, b"b" * 16]


def test_sealed_first_frames_put_the_seal_before_the_payloads():
    """pack_many(sealed_first=True): [header, seal, *payloads], which unpacks; without payloads
    the message is [header, trailer] either way."""
    framer, (ours, theirs) = Framer(), session_pair()
    frames = framer.pack_many(ours, EXAMPLES[5], [b"a" * 300, b"b" * 100], sealed_first=True)
    assert len(frames) == 4 and len(frames[1]) == TRAILER_LEN + 16 and frames[2:] == [b"a" * 300, b"b" * 100]
    got = framer.unpack(theirs, frames)
    assert got.msg == EXAMPLES[5] and [bytes(p) for p in got.payloads] == [b"a" * 300, b"b" * 100]
    frames = framer.pack_many(ours, EXAMPLES[0], [], sealed_first=True)
    assert len(frames) == 2 and len(frames[1]) == TRAILER_LEN and framer.unpack(theirs, frames).msg == EXAMPLES[0]


def session_pair(secret: bytes = b"s" * 32) -> tuple[Session, Session]:
    """Both ends of one session (initiator, responder), as a handshake with fixed nonces makes them."""
    return Session(secret, b"i" * 16, b"r" * 16, True), Session(secret, b"i" * 16, b"r" * 16, False)
