"""Router node registry and placement policies: pure logic, exact state."""
from __future__ import annotations

import pytest

from router.cluster.policy import DecodePolicy, NoNodeAvailable, Pool, PrefillPolicy, PrefixAffinity
from router.cluster.registry import HeartbeatReply, NodeLoad, NodeRegistry, NodeRole, NodeState

P, D = NodeRole.PREFILL, NodeRole.DECODE


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg(clock: FakeClock) -> NodeRegistry:
    return NodeRegistry(heartbeat_timeout_s=5.0, clock=clock)


def h(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


# ---------------------------------------------------------------- registry

def test_pools_are_separate(reg):
    """Prefill and decode nodes are listed in their own pools, sorted by id."""
    reg.register("p2", P, "tcp://a")
    reg.register("d1", D, "tcp://b")
    reg.register("p1", P, "tcp://c")
    assert [n.node_id for n in reg.candidates(P)] == ["p1", "p2"]
    assert [n.node_id for n in reg.candidates(D)] == ["d1"]
    assert [n.node_id for n in reg.nodes()] == ["d1", "p1", "p2"]


def test_register_keeps_role(reg):
    """A node id cannot change role by registering again."""
    reg.register("n", P, "tcp://a")
    with pytest.raises(ValueError, match="prefill"):
        reg.register("n", D, "tcp://a")


def test_silent_node_is_not_a_candidate_then_expires(reg, clock):
    """A node that stops heartbeating leaves the candidates, and expire() removes it."""
    reg.register("p1", P, "tcp://a")
    reg.register("p2", P, "tcp://b")
    clock.now = 4.0
    assert reg.heartbeat("p2", NodeLoad()) is HeartbeatReply.OK
    clock.now = 5.5
    assert [n.node_id for n in reg.candidates(P)] == ["p2"]
    assert reg.expire() == ["p1"]
    assert reg.get("p1") is None
    assert reg.heartbeat("p1", NodeLoad()) is HeartbeatReply.UNKNOWN


def test_heartbeat_records_load(reg, clock):
    """A heartbeat stores the reported load and refreshes liveness."""
    reg.register("d1", D, "tcp://a")
    clock.now = 3.0
    reg.heartbeat("d1", NodeLoad(num_running=3, num_waiting=1, kv_usage=0.5))
    node = reg.get("d1")
    assert node.load == NodeLoad(3, 1, 0.5) and node.last_seen == 3.0


def test_drain_waits_for_idle_then_leaves(reg):
    """A draining node gets no new work, stays while busy, and is removed at its first idle heartbeat."""
    reg.register("d1", D, "tcp://a")
    booking = reg.book("d1", 4)
    reg.drain("d1")
    assert reg.candidates(D) == [] and reg.get("d1").state is NodeState.DRAINING
    assert reg.heartbeat("d1", NodeLoad(num_running=1)) is HeartbeatReply.OK
    assert reg.heartbeat("d1", NodeLoad()) is HeartbeatReply.OK  # router still has a request there
    reg.release(booking)
    assert reg.heartbeat("d1", NodeLoad()) is HeartbeatReply.LEAVE
    assert reg.get("d1") is None


def test_register_revives_a_draining_node(reg):
    """Registering again makes a draining node ACTIVE at its new endpoint."""
    reg.register("p1", P, "tcp://a")
    reg.drain("p1")
    node = reg.register("p1", P, "tcp://b")
    assert node.state is NodeState.ACTIVE and node.endpoint == "tcp://b"
    assert reg.candidates(P) == [node]


def test_drain_unknown_node_raises(reg):
    """drain() of a node never registered is a KeyError."""
    with pytest.raises(KeyError):
        reg.drain("nope")


def test_inflight_accounting(reg):
    """book/release count requests and blocks in flight; release is idempotent, and a no-op on a
    node removed since."""
    reg.register("p1", P, "tcp://a")
    a, b = reg.book("p1", 3), reg.book("p1", 2)
    reg.release(a)
    reg.release(a)
    node = reg.get("p1")
    assert (node.inflight_requests, node.inflight_blocks) == (1, 2)
    assert reg.remove("p1") and not reg.remove("p1")
    reg.register("p1", P, "tcp://a")
    reg.release(b)
    assert (reg.get("p1").inflight_requests, reg.get("p1").inflight_blocks) == (0, 0)


def test_unreported_work_until_the_heartbeat_after_it_was_taken(reg):
    """A booking counts as unreported until the first heartbeat after the node took it; releasing
    work the last heartbeat showed counts as blocks freed until the next heartbeat."""
    seen = []
    reg = NodeRegistry(5.0, on_capacity=lambda n: seen.append(n.node_id))
    node = reg.register("d1", D, "tcp://d")
    a, b = reg.book("d1", 4), reg.book("d1", 2)
    reg.heartbeat("d1", NodeLoad())             # neither taken yet: the heartbeat shows neither
    assert (node.unreported_requests, node.unreported_blocks) == (2, 6)
    reg.taken(a)
    assert (node.unreported_requests, node.unreported_blocks) == (2, 6)
    reg.heartbeat("d1", NodeLoad())
    assert (node.unreported_requests, node.unreported_blocks) == (1, 2)
    reg.release(b)                              # never taken: nothing freed on the node
    reg.release(a)                              # taken and shown: freed since the last heartbeat
    assert (node.unreported_requests, node.unreported_blocks) == (-1, -4)
    assert (node.inflight_requests, node.inflight_blocks) == (0, 0)
    reg.heartbeat("d1", NodeLoad())
    assert (node.unreported_requests, node.unreported_blocks) == (0, 0)
    assert seen == ["d1", "d1", "d1", "d1", "d1"]   # register, 3 heartbeats, release of taken work


def test_prefill_work_counts_until_released_or_shown_and_comes_off_once(reg):
    """A local prefill's blocks count as the node's unreported prefill work from book() until
    release() or the first heartbeat after the node took it, whichever is first, and come off once:
    pending then released, taken then released, taken then shown then released all end at 0."""
    node = reg.register("d1", D, "tcp://d")
    a, b, c = reg.book("d1", 3, 3), reg.book("d1", 2, 2), reg.book("d1", 5)     # c: prefilled on P
    assert node.unreported_prefill_blocks == 5
    reg.heartbeat("d1", NodeLoad())             # none taken: the heartbeat shows none
    assert node.unreported_prefill_blocks == 5
    reg.release(a)                              # pending, released
    assert node.unreported_prefill_blocks == 2
    reg.taken(b), reg.taken(c)
    assert node.unreported_prefill_blocks == 2
    reg.heartbeat("d1", NodeLoad(2))            # shows b (a sequence): its prefill work is off
    assert node.unreported_prefill_blocks == 0
    reg.release(b), reg.release(b)              # neither taken off again nor twice
    assert (node.unreported_prefill_blocks, node.unreported_blocks) == (0, -2)
    d = reg.book("d1", 4, 4)
    reg.taken(d)
    assert node.unreported_prefill_blocks == 4
    reg.release(d)                              # taken, released before a heartbeat
    reg.release(c)
    assert (node.pending_prefill_blocks, node.since_beat_prefill_blocks, node.inflight_requests) == (0, 0, 0)


def test_a_booking_of_an_earlier_incarnation_is_never_taken(reg):
    """A booking made before its node was removed and registered again (a new incarnation: a new
    Node) is not taken by taken(): neither incarnation's counts change, no admission is woken,
    and its release leaves the new one as it was."""
    seen = []
    reg = NodeRegistry(5.0, on_capacity=lambda n: seen.append(n))
    old = reg.register("d1", D, "tcp://d")
    booking = reg.book("d1", 4, 4)
    assert reg.remove("d1")
    new = reg.register("d1", D, "tcp://d")
    seen.clear()
    reg.taken(booking, 1, 1)
    assert seen == [] and not booking.taken
    assert (old.pending_requests, old.pending_blocks, old.since_beat_blocks, old.inflight_blocks) == (1, 4, 0, 4)
    assert (new.unreported_requests, new.unreported_blocks, new.unreported_prefill_blocks) == (0, 0, 0)
    reg.release(booking)
    assert (new.inflight_requests, new.inflight_blocks, new.unreported_blocks, seen) == (0, 0, 0, [])


def test_registry_rejects_bad_timeout():
    """The heartbeat timeout must be positive."""
    with pytest.raises(ValueError):
        NodeRegistry(heartbeat_timeout_s=0)


# ---------------------------------------------------------------- prefix affinity

def test_affinity_counts_leading_run_only():
    """A hit is the longest leading run of hashes sent to the node; a gap ends it."""
    aff = PrefixAffinity(capacity_per_node=100)
    aff.record("p1", h(1, 2, 3))
    assert aff.matched_blocks("p1", h(1, 2, 3, 4)) == 3
    assert aff.matched_blocks("p1", h(1, 2, 9, 3)) == 2
    assert aff.matched_blocks("p2", h(1)) == 0


def test_affinity_lru_evicts_tail_blocks_first():
    """Over capacity the least recent hashes go, and a prompt's tail is older than its head."""
    aff = PrefixAffinity(capacity_per_node=4)
    aff.record("p1", h(1, 2, 3))
    aff.record("p1", h(5, 6))
    assert aff.size("p1") == 4
    assert aff.matched_blocks("p1", h(1, 2, 3)) == 2   # block 3 (the tail) was evicted
    assert aff.matched_blocks("p1", h(5, 6)) == 2


def test_affinity_record_refreshes():
    """Re-sending a prompt makes its hashes the most recent again."""
    aff = PrefixAffinity(capacity_per_node=3)
    aff.record("p1", h(1, 2))
    aff.record("p1", h(3))
    aff.record("p1", h(1, 2))
    aff.record("p1", h(4))
    assert aff.matched_blocks("p1", h(1, 2)) == 2
    assert aff.matched_blocks("p1", h(3)) == 0


def test_affinity_forget():
    """forget() drops a node's hashes."""
    aff = PrefixAffinity(capacity_per_node=3)
    aff.record("p1", h(1))
    aff.forget("p1")
    assert aff.matched_blocks("p1", h(1)) == 0 and aff.size("p1") == 0


# ---------------------------------------------------------------- prefill policy

def _pool(reg, role, *ids):
    for node_id in ids:
        reg.register(node_id, role, f"tcp://{node_id}")
    return reg.candidates(role)


def test_prefill_prefers_cached_prefix(reg):
    """With equal load, the node that holds the prompt's prefix wins and the hit is reported."""
    policy = PrefillPolicy(PrefixAffinity(100))
    nodes = _pool(reg, P, "p1", "p2")
    first = policy.choose(nodes, h(1, 2, 3), num_blocks=4)
    assert (first.node.node_id, first.matched_blocks, first.new_blocks) == ("p1", 0, 4)
    second = policy.choose(nodes, h(1, 2, 3, 4), num_blocks=5)
    assert (second.node.node_id, second.matched_blocks, second.new_blocks) == ("p1", 3, 2)


def test_prefill_affinity_yields_to_load(reg):
    """A cache hit loses to an idle node once the cached node's queued blocks outweigh the saving."""
    policy = PrefillPolicy(PrefixAffinity(100), load_weight=1.0)
    nodes = _pool(reg, P, "p1", "p2")
    policy.choose(nodes, h(1, 2), num_blocks=3)        # p1 now holds blocks 1, 2
    reg.book("p1", 1)
    assert policy.choose(nodes, h(1, 2), num_blocks=3).node.node_id == "p1"  # 1 + 1 < 0 + 3
    reg.book("p1", 5)
    choice = policy.choose(nodes, h(1, 2), num_blocks=3)                     # 6 + 1 > 0 + 3
    assert (choice.node.node_id, choice.matched_blocks) == ("p2", 0)


def test_prefill_spreads_cold_prompts_by_load(reg):
    """Without any hits the node with the fewest queued blocks is chosen."""
    policy = PrefillPolicy(PrefixAffinity(100))
    nodes = _pool(reg, P, "p1", "p2", "p3")
    reg.book("p1", 2)
    reg.book("p2", 1)
    assert policy.choose(nodes, h(7), num_blocks=2).node.node_id == "p3"


def test_prefill_tie_breaks_on_requests_then_id(reg):
    """Equal cost: fewer requests in flight wins, then the smaller node id."""
    policy = PrefillPolicy(PrefixAffinity(100), load_weight=0.0)
    nodes = _pool(reg, P, "p1", "p2")
    reg.book("p1", 0)
    assert policy.choose(nodes, [], num_blocks=1).node.node_id == "p2"
    reg.book("p2", 0)
    assert policy.choose(nodes, [], num_blocks=1).node.node_id == "p1"


def test_prefill_no_nodes():
    """An empty pool raises NoNodeAvailable."""
    with pytest.raises(NoNodeAvailable):
        PrefillPolicy(PrefixAffinity(1)).choose([], h(1), 1)


# ---------------------------------------------------------------- decode policy

def _pools(free: dict[str, int], num_blocks: int = 64):
    return lambda node: Pool(num_blocks, free[node.node_id])


def test_decode_ranks_by_reported_usage_plus_bookings(reg):
    """The node with the most free blocks (as reported, less what was booked since) ranks first."""
    nodes = _pool(reg, D, "d1", "d2", "d3")
    policy = DecodePolicy(_pools({"d1": 10, "d2": 60, "d3": 40}))
    assert [n.node_id for n in policy.rank(nodes)] == ["d2", "d3", "d1"]
    reg.book("d2", 30)
    assert [n.node_id for n in policy.rank(nodes)] == ["d3", "d2", "d1"]
    assert policy.free_blocks(reg.get("d2")) == 30


def test_decode_burst_alternates_between_equal_nodes(reg):
    """Equal nodes and a burst booked as it is chosen: each node gets every other request."""
    nodes = _pool(reg, D, "d1", "d2")
    policy = DecodePolicy(_pools({"d1": 64, "d2": 64}), seed=3)
    picks = []
    for _ in range(10):
        node = policy.rank(nodes)[0]
        reg.book(node.node_id, 2)
        picks.append(node.node_id)
    assert sorted(picks) == ["d1"] * 5 + ["d2"] * 5
    assert all(picks[i] != picks[i + 1] for i in range(0, 10, 2))


def test_decode_node_with_waiting_requests_ranks_last(reg):
    """A node that reports waiting requests (it runs all it can) ranks after every other."""
    nodes = _pool(reg, D, "d1", "d2")
    reg.heartbeat("d1", NodeLoad(num_running=1, num_waiting=1))
    policy = DecodePolicy(_pools({"d1": 64, "d2": 1}))
    assert [n.node_id for n in policy.rank(nodes)] == ["d2", "d1"]


def test_decode_room_is_free_blocks_less_bookings(reg):
    """Room: free blocks by the estimate cover the need; a need over the whole pool always 'fits'
    (the node itself refuses it)."""
    (node,) = _pool(reg, D, "d1")
    policy = DecodePolicy(_pools({"d1": 10}, num_blocks=64))
    assert policy.has_room(node, 10) and not policy.has_room(node, 11)
    reg.book("d1", 4)
    assert policy.has_room(node, 6) and not policy.has_room(node, 7)
    assert policy.has_room(node, 65)


def test_decode_seeded_rng_is_deterministic(reg):
    """The same seed breaks ties the same way."""
    nodes = _pool(reg, D, "d1", "d2", "d3", "d4")
    free = _pools(dict.fromkeys(["d1", "d2", "d3", "d4"], 64))
    a, b = DecodePolicy(free, seed=7), DecodePolicy(free, seed=7)
    assert [a.rank(nodes)[0].node_id for _ in range(20)] == [b.rank(nodes)[0].node_id for _ in range(20)]


def test_decode_empty():
    """No node raises NoNodeAvailable."""
    with pytest.raises(NoNodeAvailable):
        DecodePolicy(_pools({})).rank([])
