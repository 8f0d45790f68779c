"""Prefix: an O(1) snapshot of an append-only list (router/cluster/prefix.py)."""
from router.cluster.prefix import Prefix


def test_a_prefix_keeps_what_the_list_held_when_it_was_taken():
    items = [1, 2, 3]
    snap = Prefix(items)
    items += [4, 5]
    assert (len(snap), list(snap), snap[-1], snap[1:], snap[::2], snap[:10]) == (3, [1, 2, 3], 3, [2, 3], [1, 3], [1, 2, 3])
    assert snap == [1, 2, 3] and [1, 2, 3] == snap and snap == (1, 2, 3) and snap != [1, 2, 3, 4]
    assert snap != "abc" and Prefix(items) == [1, 2, 3, 4, 5] and repr(snap) == "[1, 2, 3]"
    for bad in (3, -4):
        try:
            snap[bad]
        except IndexError:
            continue
        raise AssertionError(f"snap[{bad}] did not raise")
