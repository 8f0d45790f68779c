"""The router's KV index (router/cluster/kv_index.py), the node's KV event log behind it, and the
cost function of --routing cost (router/cluster/routing_cost.py): pure logic, exact state."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.kv_events import KVEventLog
from engine.sequence import Sequence
from pdwire import control
from pdwire.block_hash import chain_hashes
from pdwire.control import KVEvents
from pdwire.schema import ProtocolError
from router.cluster.kv_index import KVIndex
from router.cluster.policy import DecodePolicy, Pool
from router.cluster.registry import NodeLoad, NodeRegistry, NodeRole
from router.cluster.routing_cost import RoutingCost


def h(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


# ---------------------------------------------------------------- the index

def test_overlap_is_the_leading_run_a_node_holds():
    """A node's overlap is the longest leading run of the prompt's hashes it stored; a removed
    hash cuts the run there; another node's entries do not count."""
    index = KVIndex(100)
    index.apply("d1", h(1, 2, 3, 5), [])
    index.apply("d2", h(1), [])
    assert [index.matched_blocks("d1", h(1, 2, 3, 4)), index.matched_blocks("d2", h(1, 2, 3, 4))] == [3, 1]
    assert index.matched_blocks("d1", h(4, 1)) == 0 and index.matched_blocks("d9", h(1)) == 0
    index.apply("d1", [], h(2))
    assert index.matched_blocks("d1", h(1, 2, 3)) == 1 and index.size("d1") == 3 and index.size() == 4


def test_reset_and_forget_drop_only_that_nodes_entries():
    """A snapshot (reset) replaces what the node said before; forget() (a new epoch, a loss)
    empties it; the other node keeps its entries."""
    index = KVIndex(100)
    index.apply("d1", h(1, 2), [])
    index.apply("d2", h(1, 2), [])
    index.apply("d1", h(7), [], reset=True)
    assert index.matched_blocks("d1", h(1)) == 0 and index.matched_blocks("d1", h(7)) == 1
    index.forget("d1")
    assert index.size("d1") == 0 and index.size() == 2 and index.matched_blocks("d2", h(1, 2)) == 2


def test_the_bound_drops_least_recent_entries_and_counts_them():
    """Past max_blocks the least recently stored or matched entries go, counted; a chain's head
    (stored last within its batch) outlives its tail."""
    index = KVIndex(4)
    index.apply("d1", h(1, 2, 3), [])
    index.apply("d2", h(9), [])
    assert index.matched_blocks("d1", h(1)) == 1            # touches d1's block 1
    index.apply("d2", h(8, 7), [])
    assert index.size() == 4 and _count(index.evictions) == 2
    assert index.matched_blocks("d1", h(1, 2, 3)) == 1      # 3 and 2 (tail first) went
    assert index.matched_blocks("d2", h(8, 7)) == 2 and index.matched_blocks("d2", h(9)) == 1


def _count(counter) -> float:
    return next(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


# ---------------------------------------------------------------- the node's event log

def test_the_event_log_replays_to_exactly_the_block_managers_cache():
    """Stores and evictions through a small pool, drained now and then into a set, end equal to
    the block manager's cached hashes; a hash stored and evicted within one batch is listed once."""
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.events = log = KVEventLog()
    view: set[bytes] = set()
    for i in range(8):
        seq = Sequence([i * 10 + j for j in range(5)], 5)
        bm.allocate(seq)
        seq.num_computed_tokens = 5
        bm.commit_computed(seq)
        bm.free(seq)
        if i % 3 == 2:
            batch = log.drain()
            assert not set(batch.stored) & set(batch.removed)
            view = (view | set(batch.stored)) - set(batch.removed)
    batch = log.drain()
    view = (view | set(batch.stored)) - set(batch.removed)
    assert view == set(bm.cached_hashes()) and len(view) == 5 and not log.pending    # of 16 stored


def test_an_overflowing_log_drops_its_hashes_and_asks_for_a_snapshot():
    """Past max_pending distinct hashes the log keeps nothing more and says it overflowed."""
    log = KVEventLog(max_pending=2)
    for x in h(1, 2, 3, 4):
        log.stored(x)
    batch = log.drain()
    assert batch == ([], [], True) and not log.pending


def test_kv_events_round_trip_and_refuse_bad_hashes():
    """KVEvents round-trips; a hash of the wrong length, too many hashes or a non-bool reset is
    a ProtocolError; DecodeRequest without local_prefill (an older router) reads False."""
    msg = KVEvents("decode-0", "e1", tuple(h(1, 2)), tuple(h(3)), True)
    assert control.decode(control.encode(msg)) == msg
    for bad in (dict(stored=(b"x" * 15,)), dict(removed=(b"y" * 16,) * (control.MAX_KV_EVENT_HASHES + 1)),
                dict(reset=1)):
        with pytest.raises(ProtocolError):
            KVEvents(**{"node_id": "d", "epoch": "e", "stored": (), "removed": (), **bad})
    old = control.encode(control.DecodeRequest("r1", (1, 2), control.SamplingParams(), "p0"))
    assert control.decode(old).local_prefill is False


# ---------------------------------------------------------------- the cost function

def _cluster(free: dict[str, int], waiting: tuple[str, ...] = ()):
    reg = NodeRegistry(heartbeat_timeout_s=5.0)
    for node_id in free:
        reg.register(node_id, NodeRole.DECODE, "tcp://x")
        reg.heartbeat(node_id, NodeLoad(1, int(node_id in waiting)))
    decode = DecodePolicy(lambda n: Pool(100, free[n.node_id]))
    return reg, decode


def test_decode_nodes_rank_by_uncached_blocks_plus_weighted_use():
    """cost = prompt blocks D lacks + decode_load_weight x blocks in use: the overlap wins against
    a little load, loses against much; a node with waiting requests goes last whatever it holds."""
    reg, decode = _cluster({"d1": 90, "d2": 60, "d3": 100}, waiting=("d3",))
    index = KVIndex(100)
    prompt = list(range(64))                                 # 4 blocks of 16
    hashes = chain_hashes(prompt, 16)
    index.apply("d2", hashes[:3], [])
    index.apply("d3", hashes[:3], [])
    rank = lambda weight: [n.node_id for n in RoutingCost(index, decode, weight).rank(reg.nodes(), hashes, 64, 16)]
    assert rank(0.05) == ["d2", "d1", "d3"]                  # 1 + 2 < 4 + 0.5
    assert rank(1.0) == ["d1", "d2", "d3"]                   # 4 + 10 < 1 + 40
    reg.book("d1", 50)                                       # bookings count as use at once
    assert rank(0.05) == ["d2", "d1", "d3"] and rank(1.0) == ["d2", "d1", "d3"]


def test_prefill_work_booked_on_a_decode_node_since_its_heartbeat_counts_in_its_cost():
    """Both nodes hold the prompt's 3 usable blocks (1 uncached on each); d1 has 10 blocks in use,
    d2 13. A booking of 2 blocks on d1 that a prefill node computes leaves d1 cheaper (1 + 12 < 1 +
    13); booked as d1's own local prefill, its 2 blocks of queued work make d1 dearer (1 + 2 + 12 >
    14), until d1's heartbeat shows the request (1 + 10, the fixed pool standing for its report)."""
    reg, decode = _cluster({"d1": 90, "d2": 87})
    index = KVIndex(100)
    hashes = chain_hashes(list(range(64)), 16)
    for node_id in ("d1", "d2"):
        index.apply(node_id, hashes[:3], [])
    rank = lambda: [n.node_id for n in RoutingCost(index, decode).rank(reg.nodes(), hashes, 64, 16)]
    remote = reg.book("d1", 2)
    assert rank() == ["d1", "d2"]
    reg.release(remote)
    local = reg.book("d1", 2, 2)
    assert rank() == ["d2", "d1"]
    reg.taken(local)
    assert rank() == ["d2", "d1"]
    reg.heartbeat("d1", NodeLoad(2))
    assert rank() == ["d1", "d2"]


def test_the_decode_node_prefills_when_few_uncached_tokens_remain():
    """prefill_here when prompt tokens - cached blocks x block size <= the threshold; the
    prompt's last token is always computed, so a fully cached prompt still has one to compute."""
    reg, decode = _cluster({"d1": 100})
    (d1,) = reg.nodes()
    index = KVIndex(100)
    prompt = list(range(70))                                 # 4 full blocks + 6 tokens
    hashes = chain_hashes(prompt, 16)
    index.apply("d1", hashes[:3], [])
    here = lambda threshold, n=70: RoutingCost(index, decode, 1.0, threshold).prefill_here(d1, hashes, n, 16)
    assert [here(21), here(22), here(0)] == [False, True, False]      # 70 - 48 = 22 uncached
    index.apply("d1", hashes[3:], [])
    assert here(6) and not here(5)                            # 70 - 64
    assert here(16, 64) and not here(15, 64)                  # 64 tokens: 3 usable blocks, 16 left


def test_the_load_guard_sends_a_request_to_the_idlest_decode_node_when_loads_are_far_apart():
    """d1 holds the whole prompt, d2 nothing: the cost prefers d1 until d1 runs more than 32
    sequences above d2 and more than 1.5x as many (sgl-router's guard); then d2, the idlest, goes
    first. Bookings since the last heartbeat count as sequences; balance=None turns it off."""
    reg = NodeRegistry(heartbeat_timeout_s=5.0)
    for node_id in ("d1", "d2"):
        reg.register(node_id, NodeRole.DECODE, "tcp://x")
    decode = DecodePolicy(lambda n: Pool(1000, 900))
    index = KVIndex(100)
    hashes = chain_hashes(list(range(64)), 16)
    index.apply("d1", hashes, [])

    def rank(d1_running: int, d2_running: int, balance=(32, 1.5)) -> list[str]:
        reg.heartbeat("d1", NodeLoad(d1_running, 0))
        reg.heartbeat("d2", NodeLoad(d2_running, 0))
        return [n.node_id for n in RoutingCost(index, decode, 1.0, balance=balance).rank(reg.nodes(), hashes, 64, 16)]
    assert rank(30, 5) == ["d1", "d2"]                       # 25 apart: the cache wins
    assert rank(40, 5) == ["d2", "d1"]                       # 35 apart and 8x: the idlest
    assert rank(40, 5, balance=None) == ["d1", "d2"]
    assert rank(140, 100) == ["d1", "d2"]                    # 40 apart but under 1.5x
    assert rank(36, 3) == ["d2", "d1"]
    reg.book("d2", 4)
    reg.book("d2", 4)                                        # d2 now 5: 31 apart
    assert rank(36, 3) == ["d1", "d2"]


def test_the_load_guard_flags_are_checked():
    from router.config import RouterConfig
    with pytest.raises(ValueError):
        RouterConfig(decode_balance_rel=0.5)
    with pytest.raises(ValueError):
        RouterConfig(decode_balance_abs=-1)
