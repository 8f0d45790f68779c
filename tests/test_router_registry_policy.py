"""Router node registry and placement policies: pure logic, exact state."""
from __future__ import annotations

import pytest

from router.policy import DecodePolicy, NoNodeAvailable, PrefillPolicy, PrefixAffinity
from router.registry import HeartbeatReply, NodeLoad, NodeRegistry, NodeRole, NodeState

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
    reg.begin("d1", 4)
    reg.drain("d1")
    assert reg.candidates(D) == [] and reg.get("d1").state is NodeState.DRAINING
    assert reg.heartbeat("d1", NodeLoad(num_running=1)) is HeartbeatReply.OK
    assert reg.heartbeat("d1", NodeLoad()) is HeartbeatReply.OK  # router still has a request there
    reg.end("d1", 4)
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
    """begin/end count requests and blocks in flight; end on a removed node is a no-op."""
    reg.register("p1", P, "tcp://a")
    reg.begin("p1", 3)
    reg.begin("p1", 2)
    reg.end("p1", 3)
    node = reg.get("p1")
    assert (node.inflight_requests, node.inflight_blocks) == (1, 2)
    assert reg.remove("p1") and not reg.remove("p1")
    reg.end("p1", 2)


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
    reg.begin("p1", 1)
    assert policy.choose(nodes, h(1, 2), num_blocks=3).node.node_id == "p1"  # 1 + 1 < 0 + 3
    reg.begin("p1", 5)
    choice = policy.choose(nodes, h(1, 2), num_blocks=3)                     # 6 + 1 > 0 + 3
    assert (choice.node.node_id, choice.matched_blocks) == ("p2", 0)


def test_prefill_spreads_cold_prompts_by_load(reg):
    """Without any hits the node with the fewest queued blocks is chosen."""
    policy = PrefillPolicy(PrefixAffinity(100))
    nodes = _pool(reg, P, "p1", "p2", "p3")
    reg.begin("p1", 2)
    reg.begin("p2", 1)
    assert policy.choose(nodes, h(7), num_blocks=2).node.node_id == "p3"


def test_prefill_tie_breaks_on_requests_then_id(reg):
    """Equal cost: fewer requests in flight wins, then the smaller node id."""
    policy = PrefillPolicy(PrefixAffinity(100), load_weight=0.0)
    nodes = _pool(reg, P, "p1", "p2")
    reg.begin("p1", 0)
    assert policy.choose(nodes, [], num_blocks=1).node.node_id == "p2"
    reg.begin("p2", 0)
    assert policy.choose(nodes, [], num_blocks=1).node.node_id == "p1"


def test_prefill_no_nodes():
    """An empty pool raises NoNodeAvailable."""
    with pytest.raises(NoNodeAvailable):
        PrefillPolicy(PrefixAffinity(1)).choose([], h(1), 1)


# ---------------------------------------------------------------- decode policy

def test_decode_two_choices_picks_lower_kv_usage(reg):
    """Of the two sampled nodes the lower KV usage wins; the emptiest node never loses a pair."""
    nodes = _pool(reg, D, "d1", "d2", "d3")
    for i, node_id in enumerate(["d1", "d2", "d3"]):
        reg.heartbeat(node_id, NodeLoad(kv_usage=[0.9, 0.1, 0.5][i]))
    picks = [DecodePolicy(seed=s).choose(nodes).node_id for s in range(30)]
    assert "d1" not in picks and {"d2", "d3"} <= set(picks)
    assert picks.count("d2") > picks.count("d3")


def test_decode_seeded_rng_is_deterministic(reg):
    """The same seed gives the same sequence of choices."""
    nodes = _pool(reg, D, "d1", "d2", "d3", "d4")
    a, b = DecodePolicy(seed=7), DecodePolicy(seed=7)
    assert [a.choose(nodes).node_id for _ in range(20)] == [b.choose(nodes).node_id for _ in range(20)]


def test_decode_tie_on_usage_uses_inflight(reg):
    """Equal KV usage: the node with fewer requests in flight wins."""
    nodes = _pool(reg, D, "d1", "d2")
    reg.begin("d1", 1)
    assert DecodePolicy(seed=0).choose(nodes).node_id == "d2"


def test_decode_single_and_empty(reg):
    """One node is always chosen; none raises NoNodeAvailable."""
    nodes = _pool(reg, D, "d1")
    assert DecodePolicy().choose(nodes).node_id == "d1"
    with pytest.raises(NoNodeAvailable):
        DecodePolicy().choose([])
