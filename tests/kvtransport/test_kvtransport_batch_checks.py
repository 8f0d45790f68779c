"""A batch's checks done in one step (C-level operations, for the receive path's cold caches) decide
exactly as the field-by-field and block-by-block checks they stand in for."""
import random

import pytest

import pdwire.messages as messages
from kvtransport.metrics import DropReason
from kvtransport.framing import FrameError
from kvtransport.receiver_state import ReceiveLedger, Reservation
from pdwire.handshake import KVLayout
from pdwire.messages import MAX_BATCH_BLOCKS, BlockBatch, LayerBatch
from pdwire.schema import MAX_BLOCKS, ProtocolError, check_ints

GOOD = dict(xfer_id="d0-1f.7:a/b", indices=[4, 5, 6, 9], block_ids=[40, 12, 13, 7], nbytes=1 << 20,
            dtype="float32", shape=[8, 2, 16, 8, 64])
BAD_VALUES = {      # per field: values either check may see (valid ones at the limits among them)
    "xfer_id": ["", "x" * 64, "x" * 65, "a b", "é", 7, None, b"x1", ["x1"]],
    "indices": [[], [0], [MAX_BLOCKS - 1], [MAX_BLOCKS], [-1], [1, 1], [True], [1.0], ["1"], [1, None],
                list(range(MAX_BATCH_BLOCKS)), list(range(MAX_BATCH_BLOCKS + 1)), (1, 2, 3, 4), 5, "1234"],
    "block_ids": [[], [(1 << 31) - 1, 0, 1, 2], [1 << 31, 0, 1, 2], [-1, 0, 1, 2], [3, 3, 1, 2], [False, 0, 1, 2],
                  [0, 1, 2], [0, 1, 2, 3, 4], (40, 12, 13, 7), None],
    "nbytes": [0, 1, 1 << 34, (1 << 34) + 1, -1, True, 1.5, "64", None],
    "dtype": ["bfloat16", "float8_e5m2", "int8", "", "f" * 33, 4, None],
    "shape": [[], [1], [1 << 20], [(1 << 20) + 1], [0], [2] * 8, [2] * 9, [True, 2], [2.0], (8, 2), None, "82"],
}


def _outcome(cls, values):
    """The message cls(*values) makes, or the ProtocolError text it raises."""
    try:
        return cls(*values)
    except ProtocolError as e:
        return str(e)


def _cases():
    for name, bad in BAD_VALUES.items():
        for value in bad:
            yield {**GOOD, name: value}
    rng = random.Random(7)
    for _ in range(300):        # two fields off at once: the checks' order decides which is named
        a, b = rng.sample(sorted(BAD_VALUES), 2)
        yield {**GOOD, a: rng.choice(BAD_VALUES[a]), b: rng.choice(BAD_VALUES[b])}


@pytest.mark.parametrize("cls", [BlockBatch, LayerBatch])
def test_a_batch_header_checked_in_one_step_is_what_the_field_checks_make(cls, monkeypatch):
    """Every header, good or bad in one or two fields: the same message (tuples where lists came)
    or the same ProtocolError as with the one-step check turned off; the one step takes the good."""
    cases = [list(c.values()) for c in _cases()]
    if cls is LayerBatch:
        cases = [[*c[:3], layer, *c[3:]] for c in cases for layer in (0, 1 << 17)]
    fast = [_outcome(cls, values) for values in cases]
    monkeypatch.setattr(messages, "_batch_fields_pass", lambda msg: False)
    slow = [_outcome(cls, values) for values in cases]
    assert fast == slow
    assert sum(type(m) is cls for m in fast) > 30
    assert all(type(m.indices) is tuple and type(m.shape) is tuple for m in fast if type(m) is cls)


def test_the_one_step_check_takes_a_good_batch():
    """The usual header does not fall back to the field checks (else the one step saves nothing)."""
    msg = BlockBatch(*GOOD.values())
    assert messages._batch_fields_pass(msg)


def test_check_ints_in_one_step_names_the_first_bad_item():
    """check_ints: ints (no bool) within [lo, hi] pass as a tuple; else the first bad item is named."""
    assert check_ints([3, 1, 2], "v", 4, lo=1, hi=3) == (3, 1, 2)
    assert check_ints([], "v", 4) == ()
    for bad, named in (([1, 4], "v[1]"), ([0, 2], "v[0]"), ([1, True], "v[1]"), ([2, 2.0], "v[1]")):
        with pytest.raises(ProtocolError, match=rf"{named.replace('[', '.').replace(']', '.')}"):
            check_ints(bad, "v", 4, lo=1, hi=3)


LAYOUT = KVLayout("0123abcd", "float32", 16, 4, 2, 8)


def _ledger_with_history(rng):
    """A ledger with one transfer part-written (whole blocks and single layers) and its reservation."""
    ledger = ReceiveLedger(LAYOUT, 64)
    res = Reservation("x", tuple(rng.sample(range(64), 12)), cached_prefix_blocks=2)
    ledger.register(res)
    ledger.pair("p", "node-p")
    layer_nbytes = LAYOUT.block_nbytes // LAYOUT.num_layers
    for index in rng.sample(range(2, 12), 3):           # whole blocks written
        ledger.mark_written("p", BlockBatch("x", (index,), (res.dst_block_ids[index],), LAYOUT.block_nbytes,
                                            "float32", LAYOUT.block_shape))
    for index in rng.sample(range(2, 12), 2):           # one layer of some blocks
        if index in ledger._live["x"].missing:
            ledger.mark_written("p", LayerBatch("x", (index,), (res.dst_block_ids[index],), 1, layer_nbytes,
                                                "float32", (1, *LAYOUT.block_shape[1:])))
    return ledger, res


def _reason(ledger, batch, lens):
    try:
        ledger.check_batch("p", batch, lens)
    except FrameError as e:
        return e.reason, e.detail
    return None


def test_a_batch_checked_against_the_ledger_at_once_is_what_block_checks_make(monkeypatch):
    """Batches of random indices (cached, missing, written, half-written, past the table) and right
    or wrong block ids: check_batch passes or drops each with the reason and block the per-block
    checks name, whole blocks and layer slices alike."""
    rng, cases = random.Random(3), []
    for _ in range(40):
        ledger, res = _ledger_with_history(rng)
        for _ in range(30):
            indices = tuple(rng.sample(range(14), rng.randint(1, 5)))
            ids = tuple(res.dst_block_ids[i] if i < 12 and rng.random() < 0.9 else 100 + i for i in indices)
            if rng.random() < 0.5:
                batch = BlockBatch("x", indices, ids, LAYOUT.block_nbytes, "float32", LAYOUT.block_shape)
                lens = [LAYOUT.block_nbytes] * len(indices)
            else:
                first = rng.randint(0, 3)
                batch = LayerBatch("x", indices, ids, first, LAYOUT.block_nbytes // 4, "float32",
                                   (1, *LAYOUT.block_shape[1:]))
                lens = [LAYOUT.block_nbytes // 4] * len(indices)
            cases.append((ledger, batch, lens))
    fast = [_reason(*c) for c in cases]
    monkeypatch.setattr(ReceiveLedger, "_slots_free", staticmethod(lambda *args: False))
    assert fast == [_reason(*c) for c in cases]
    reasons = {r[0] if r else None for r in fast}
    assert reasons == {None, DropReason.NOT_RESERVED, DropReason.DUPLICATE}
