"""A decode node's reservation says how many blocks it took from the free ones (the router books
that figure, router/cluster/admission.py _taken): cached blocks no request uses count as free
until a reservation takes them, cached blocks in use do not."""
from __future__ import annotations

from tests.decode_blocks import DecodeBlocks

BS = 4


def _doc(i: int) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + 10 * BS))      # 10 full blocks


def test_reservations_on_different_unused_documents_report_every_block_they_take():
    """200 blocks, 6 documents of 10 blocks cached and unused: a question on each (11 blocks, 10
    cached) takes 11 blocks from the free count, not 1; the free count goes 200 -> 134 and the
    reported figures add up to the drop."""
    node = DecodeBlocks(200, BS)
    for i in range(6):
        node.cache(_doc(i))
    assert node.bm.num_free_blocks == 200
    got = [node.reserve(f"q{i}", _doc(i) + [7, 8]) for i in range(6)]
    assert [(r.cached_blocks, r.taken_blocks, len(r.block_table)) for r in got] == [(10, 11, 11)] * 6
    assert node.bm.num_free_blocks == 200 - sum(r.taken_blocks for r in got) == 134
    node.check_integrity()


def test_a_reservation_sharing_blocks_in_use_reports_only_its_new_ones():
    """A second question on a document the first one's reservation holds takes 1 block (its
    cached 10 are in use already), and one on nothing cached takes all of its blocks."""
    node = DecodeBlocks(200, BS)
    node.cache(_doc(0))
    first, second = node.reserve("q0", _doc(0) + [7, 8]), node.reserve("q1", _doc(0) + [9, 10])
    fresh = node.reserve("q2", _doc(1) + [7, 8])
    assert [(r.cached_blocks, r.taken_blocks) for r in (first, second, fresh)] == [(10, 11), (10, 1), (0, 11)]
    assert node.bm.num_free_blocks == 200 - 23
    node.abort("q1")
    assert node.bm.num_free_blocks == 200 - 22
    node.check_integrity()
