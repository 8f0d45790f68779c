"""The simulated router's prefill choice prices what router/cluster/policy.py prices: blocks booked
on a node plus the prompt's blocks never sent there, with the hashes recorded at choice time."""
from __future__ import annotations

from pdplan.sim_affinity import PrefixAffinity

DOC = tuple(range(100, 110))            # 10 chained block hashes


def test_a_prefix_sent_to_a_node_makes_it_the_cheapest_once_its_booking_ends():
    """After the first request's first token, a second one sharing its 10 blocks costs 1 new block there."""
    a = PrefixAffinity(3, load=lambda i: 0)
    node, new = a.choose(DOC + (1,), 11)
    assert (node, new) == (0, 11) and a.booked_blocks == [11, 0, 0]
    a.release(node, new)
    assert a.choose(DOC + (2,), 11) == (0, 1)
    assert a.matched(0, DOC + (2,)) == 11 and a.matched(1, DOC) == 0


def test_while_a_node_is_booked_an_equal_cost_goes_to_the_one_with_fewer_requests():
    """Doc being prefilled on node 0 (11 blocks booked): node 0 costs 11 + 1, node 1 costs 11: node 1."""
    a = PrefixAffinity(2, load=lambda i: 0)
    a.choose(DOC + (1,), 11)
    assert a.choose(DOC + (2,), 11) == (1, 11)


def test_ties_fall_to_the_node_running_fewer_sequences():
    """Nothing booked or cached anywhere: the node with the lower heartbeat load wins."""
    loads = [5, 2, 7]
    assert PrefixAffinity(3, load=lambda i: loads[i]).choose(DOC, 10) == (1, 10)


def test_the_lru_forgets_a_chain_from_its_tail():
    """Capacity 6: recording 10 blocks keeps the first 6 (leading blocks are the newest)."""
    a = PrefixAffinity(1, load=lambda i: 0, capacity=6)
    a.choose(DOC, 10)
    assert a.matched(0, DOC) == 6


def test_the_colocated_guard_sends_to_the_idlest_when_loads_are_far_apart():
    """Loads 40 and 5 (over 32 apart, over 1.5x): the idlest replica, though the other holds the prefix."""
    loads = [40, 5]
    a = PrefixAffinity(2, load=lambda i: loads[i], balance=True)
    a.sent[0].update(dict.fromkeys(DOC))
    assert a.choose(DOC + (1,), 11) == (1, 11)
    loads[0] = 30                                       # 25 apart: the prefix wins again
    assert a.choose(DOC + (2,), 11)[0] == 0
