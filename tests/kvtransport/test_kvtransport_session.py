"""Sessions on the node network: keys per direction, the replay window, bounded handshakes."""
import hmac
import struct

import pytest

from kvtransport.fake import ManualClock
from kvtransport.metrics import DropReason
from kvtransport.session import (MAX_SEALED_PAYLOADS, REPLAY_WINDOW, SEQ_LEN, TRAILER_LEN, AuthError, AuthKind, Initiator,
                                 MacKey, Responder, Session, auth_frame, parse_auth_frame)

SECRET = b"k" * 32


def _pair():
    return Session(SECRET, b"i" * 16, b"r" * 16, True), Session(SECRET, b"i" * 16, b"r" * 16, False)


def _sealed(session, header=b"h"):
    return [header, session.seal(header)]


def test_each_direction_has_its_own_key():
    """What one end seals opens at the other end only: a message reflected back to its sender fails."""
    i, r = _pair()
    msg = _sealed(i)
    assert r.open(msg) == [b"h"]
    with pytest.raises(AuthError) as e:
        i.open(_sealed(i))
    assert e.value.reason is DropReason.BAD_MAC


def test_replay_window_takes_reordered_messages_once_and_drops_replays_and_stragglers():
    """Inside the window a late message is taken once; a repeat, or one a window or more behind
    the newest, is a REPLAY."""
    i, r = _pair()
    msgs = [_sealed(i, bytes([k])) for k in range(REPLAY_WINDOW + 3)]
    r.open(msgs[2])
    r.open(msgs[0])                                   # late, inside the window
    for again in (msgs[0], msgs[2]):
        with pytest.raises(AuthError) as e:
            r.open(again)
        assert e.value.reason is DropReason.REPLAY
    r.open(msgs[REPLAY_WINDOW + 2])
    r.open(msgs[3])                                   # 63 behind: still inside
    with pytest.raises(AuthError) as e:
        r.open(msgs[1])                               # 65 behind: outside
    assert e.value.reason is DropReason.REPLAY


def test_responder_handshake_opens_a_session_only_with_the_secret():
    """A challenge answers any hello; a first message sealed with the secret opens the session, one
    sealed with another secret does not, and a connection without a hello is NOT_AUTHENTICATED."""
    responder = Responder(SECRET)
    for peer, secret, ok in (("p", b"w" * 32, False), ("p2", SECRET, True)):
        initiator = Initiator(secret)
        kind, nonce = parse_auth_frame([initiator.hello()])
        assert kind is AuthKind.HELLO
        kind, nonce_r = parse_auth_frame([responder.challenge(peer, nonce)])
        session = initiator.on_challenge(nonce_r)
        if ok:
            assert responder.open(peer, _sealed(session))[1] == [b"h"]
            assert responder.session(peer) is not None
        else:
            with pytest.raises(AuthError) as e:
                responder.open(peer, _sealed(session))
            assert e.value.reason is DropReason.BAD_MAC and responder.session(peer) is None
    with pytest.raises(AuthError) as e:
        responder.open("q", [b"h", b"t" * 40])
    assert e.value.reason is DropReason.NOT_AUTHENTICATED


def test_pending_handshakes_are_bounded_in_number_and_age():
    """A flood of hellos keeps at most max_pending handshakes (oldest dropped); one older than the
    TTL cannot be completed."""
    clock = ManualClock()
    responder = Responder(SECRET, max_pending=4, pending_ttl_s=5.0, clock=clock)
    for k in range(100):
        responder.challenge(f"p{k}", b"n" * 16)
    assert responder.num_pending == 4
    initiator = Initiator(SECRET)
    initiator.hello()
    session = initiator.on_challenge(parse_auth_frame([responder.challenge("late", b"x" * 16)])[1])
    clock.advance(6.0)
    with pytest.raises(AuthError) as e:
        responder.open("late", _sealed(session))
    assert e.value.reason is DropReason.NOT_AUTHENTICATED


def test_sessions_are_bounded_and_the_least_recently_used_goes_first():
    """Past max_sessions the session a peer used least recently is forgotten; one in use stays."""
    responder = Responder(SECRET, max_sessions=2)
    sessions = {}
    for peer in ("a", "b", "c"):
        initiator = Initiator(SECRET)
        nonce = parse_auth_frame([initiator.hello()])[1]
        sessions[peer] = initiator.on_challenge(parse_auth_frame([responder.challenge(peer, nonce)])[1])
        responder.open(peer, _sealed(sessions[peer]))
        if peer == "b":
            responder.open("a", _sealed(sessions["a"]))        # a is used again: b is now the oldest
    assert responder.num_sessions == 2
    assert [responder.session(p) is not None for p in "abc"] == [True, False, True]
    with pytest.raises(AuthError) as e:
        responder.open("b", _sealed(sessions["b"]))
    assert e.value.reason is DropReason.NOT_AUTHENTICATED


def test_only_well_formed_handshake_frames_parse():
    """A handshake frame is MAGIC, a kind and (but for RESET) a 16-byte nonce: anything else is not one."""
    assert parse_auth_frame([auth_frame(AuthKind.RESET)]) == (AuthKind.RESET, b"")
    for frames in ([auth_frame(AuthKind.HELLO, b"n" * 15)], [auth_frame(AuthKind.RESET) + b"x"],
                   [b"PDA1z" + b"n" * 16], [auth_frame(AuthKind.HELLO, b"n" * 16), b""]):
        assert parse_auth_frame(frames) is None


def test_a_connection_gets_one_challenge_and_one_reset_however_many_it_asks_for():
    """A second hello while a connection's handshake is pending, and a second sealed message from a
    connection without a session, are not answered (a flood costs one reply); once the handshake
    has expired the connection may say hello again, and once a session opens it may be reset again."""
    clock = ManualClock()
    responder = Responder(SECRET, pending_ttl_s=5.0, clock=clock)
    assert parse_auth_frame([responder.challenge("p", b"n" * 16)])[0] is AuthKind.CHALLENGE
    assert [responder.challenge("p", b"m" * 16) for _ in range(100)] == [None] * 100
    assert [responder.refuse("q") for _ in range(3)] == [auth_frame(AuthKind.RESET), None, None]
    clock.advance(6.0)
    initiator = Initiator(SECRET)
    nonce = parse_auth_frame([initiator.hello()])[1]
    session = initiator.on_challenge(parse_auth_frame([responder.challenge("p", nonce)])[1])
    assert responder.refuse("p") == auth_frame(AuthKind.RESET)
    assert responder.open("p", _sealed(session))[1] == [b"h"]
    responder.forget("p")
    assert responder.refuse("p") == auth_frame(AuthKind.RESET)


def test_a_jump_in_sequence_numbers_costs_nothing():
    """A sealed message numbered 2**63 is taken at once (no 2**63-bit window is built) and everything
    before it is then a REPLAY."""
    i, r = _pair()
    first, second = _sealed(i), _sealed(i)
    r.open(second)
    i._send_seq = 1 << 63
    assert r.open(_sealed(i, b"j")) == [b"j"]
    with pytest.raises(AuthError) as e:
        r.open(first)
    assert e.value.reason is DropReason.REPLAY


def _reason(fn, *args):
    with pytest.raises(AuthError) as e:
        fn(*args)
    return e.value.reason


def test_the_seal_goes_first_and_its_lengths_are_checked_before_and_after_the_payloads():
    """[header, seal, *payloads]: open_seal verifies the MAC over the header and the declared
    lengths (no payload needed) and returns them; open() of the whole message also compares the
    payloads with them (BAD_NBYTES). A changed length, header or tag is BAD_MAC and takes no
    sequence number; a second copy is a REPLAY."""
    ours, theirs = _pair()
    seal = ours.seal_first(b"hdr", [300, 100])
    assert len(seal) == TRAILER_LEN + 16
    assert _reason(theirs.open_seal, b"hdr", seal[:-8] + (101).to_bytes(8, "little")) is DropReason.BAD_MAC
    assert _reason(theirs.open_seal, b"hdX", seal) is DropReason.BAD_MAC
    assert _reason(theirs.open_seal, b"hdr", seal[:TRAILER_LEN]) is DropReason.BAD_MAC     # no lengths
    tag_flipped = seal[:SEQ_LEN] + bytes([seal[SEQ_LEN] ^ 1]) + seal[SEQ_LEN + 1:]
    assert _reason(theirs.open, [b"hdr", tag_flipped, b"a" * 300, b"b" * 100]) is DropReason.BAD_MAC
    assert theirs.open_seal(b"hdr", seal) == [300, 100]
    assert _reason(theirs.open, [b"hdr", seal, b"a" * 300, b"b" * 100]) is DropReason.REPLAY
    assert theirs.open([b"hdr", ours.seal_first(b"hdr", [3]), b"abc"]) == [b"hdr", b"abc"]
    for payloads in ([b"a" * 300], [b"a" * 300, b"b" * 99], [b"a" * 300, b"b" * 100, b"c"]):
        bad = [b"hdr", ours.seal_first(b"hdr", [300, 100]), *payloads]
        assert _reason(theirs.open, bad) is DropReason.BAD_NBYTES
    with pytest.raises(ValueError):
        ours.seal_first(b"hdr", [])


def test_a_seal_and_a_trailer_never_share_a_tag():
    """The seal's MAC also covers its form and payload count: the tag of a seal for one payload of
    n bytes is not the trailer's for [header, payload of n] (same key and sequence number), so
    neither verifies as the other."""
    ours, theirs = _pair()
    seal = ours.seal_first(b"hdr", [3])
    ours_again, theirs_again = _pair()
    trailer = ours_again.seal(b"hdr", b"abc")
    assert seal[:SEQ_LEN] == trailer[:SEQ_LEN] and seal[SEQ_LEN:TRAILER_LEN] != trailer[SEQ_LEN:]
    assert _reason(theirs.open, [b"hdr", b"abc", seal[:TRAILER_LEN]]) is DropReason.BAD_MAC
    assert _reason(theirs_again.open_seal, b"hdr", trailer + (3).to_bytes(8, "little")) is DropReason.BAD_MAC


def test_the_older_order_still_opens_even_when_a_payload_looks_like_a_seal():
    """[header, payload*, trailer] from a sender before the seal opens by its trailer, also when
    its first payload has a seal's shape (its MAC fails as a seal, taking nothing)."""
    ours, theirs = _pair()
    for first in (b"x" * (TRAILER_LEN + 8), b"y" * 4096):
        frames = [b"hdr", first, b"z" * 16, ours.seal(b"hdr", first, b"z" * 16)]
        assert theirs.open(frames) == frames[:-1]


def test_a_responder_opens_a_seal_only_under_an_established_session_without_a_pending_one():
    """check_seal: NOT_AUTHENTICATED before the session and while a new handshake is pending; a
    wrong header is BAD_MAC and takes no sequence number; the same seal twice is a REPLAY."""
    clock, initiator = ManualClock(), Initiator(SECRET)
    responder = Responder(SECRET, clock=clock)
    session = initiator.on_challenge(parse_auth_frame([responder.challenge("p", parse_auth_frame(
        [initiator.hello()])[1])])[1])
    assert _reason(responder.check_seal, "p", b"h", session.seal_first(b"h", [1])) is DropReason.NOT_AUTHENTICATED
    responder.open("p", [b"hello", session.seal(b"hello")])
    seal = session.seal_first(b"h", [5])
    assert _reason(responder.check_seal, "p", b"g", seal) is DropReason.BAD_MAC
    responder.check_seal("p", b"h", seal)
    assert _reason(responder.check_seal, "p", b"h", seal) is DropReason.REPLAY
    responder.challenge("p", b"n" * 16)               # a new handshake on that connection
    assert _reason(responder.check_seal, "p", b"h", session.seal_first(b"h", [1])) is DropReason.NOT_AUTHENTICATED


def test_a_mac_key_computes_hmac_sha256():
    """MacKey (the padded key blocks hashed once) gives hmac's HMAC-SHA256 for keys up to a
    SHA-256 block and messages in any number of parts; a longer key is refused, not hashed."""
    for key in (b"", b"k", bytes(range(32)), b"x" * 63, b"y" * 64):
        mac = MacKey(key)
        for parts in ([], [b""], [b"abc"], [b"a" * 55, b"b" * 9, memoryview(b"c" * 200)]):
            assert mac.digest(*parts) == hmac.digest(key, b"".join(parts), "sha256")
    with pytest.raises(ValueError):
        MacKey(b"z" * 65)


def test_trailers_and_seals_are_the_documented_bytes():
    """The wire form, recomputed with hmac.digest from the module docstring: trailer = seq ||
    HMAC(key, seq || sizes || header), seal = seq || HMAC(key, "S" || count || seq || sizes ||
    header) || lengths, key = HMAC(secret, "pdserve-session-v1 i2r" || nonce_i || nonce_r)."""
    key = hmac.digest(SECRET, b"pdserve-session-v1 i2r" + b"i" * 16 + b"r" * 16, "sha256")
    ours, _ = _pair()
    header = b"h" * 100
    seq0, seq1, seq2 = (n.to_bytes(8, "little") for n in range(3))
    assert ours.seal(header) == seq0 + hmac.digest(key, seq0 + struct.pack("<2Q", 100, 0) + header, "sha256")
    assert ours.seal(header, b"ab", b"cde") == \
        seq1 + hmac.digest(key, seq1 + struct.pack("<3Q", 100, 2, 3) + header, "sha256")
    lengths = [2 << 20] * 8
    assert ours.seal_first(header, lengths) == seq2 + hmac.digest(
        key, b"S" + struct.pack("<Q", 8) + seq2 + struct.pack("<9Q", 100, *lengths) + header, "sha256") + \
        struct.pack("<8Q", *lengths)


def test_check_seal_verifies_what_open_seal_verifies_from_the_seals_own_bytes():
    """check_seal (the MAC's input joined from the seal's packed bytes) accepts a seal of 1, 2 or
    MAX_SEALED_PAYLOADS lengths of its form only; a seal of the other form, a changed length, a
    cut or lengthened seal, and one of 0 or too many lengths are BAD_MAC, and take no number."""
    for count in (1, 2, MAX_SEALED_PAYLOADS):
        for split in (False, True):
            ours, theirs = _pair()
            lengths = [(k + 1) << 20 for k in range(count)]
            seal = ours.seal_first(b"hdr", lengths, split)
            for bad in (seal[:-8] + (7).to_bytes(8, "little"), seal[:-1], seal + b"\0", seal + bytes(8),
                        seal[:TRAILER_LEN]):
                assert _reason(theirs.check_seal, b"hdr", bad, split) is DropReason.BAD_MAC
            assert _reason(theirs.check_seal, b"hdr", seal, not split) is DropReason.BAD_MAC
            theirs.check_seal(b"hdr", seal, split)
            assert _reason(theirs.open_seal, b"hdr", seal, split) is DropReason.REPLAY
    ours, theirs = _pair()
    too_many = ours.seal_first(b"hdr", [1] * MAX_SEALED_PAYLOADS)[:TRAILER_LEN] + bytes(8 * (MAX_SEALED_PAYLOADS + 1))
    assert _reason(theirs.check_seal, b"hdr", too_many) is DropReason.BAD_MAC
