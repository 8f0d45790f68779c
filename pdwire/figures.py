"""A node's figures in one record: the engine's load and the KV transfer counters. The node builds
it each heartbeat, NodeStatus carries it (flat on the wire), the router reads it back for /metrics."""
from __future__ import annotations

from typing import NamedTuple


class TransferCounters(NamedTuple):
    """KV transfer totals since the node started (a prefill node sends, a decode node receives).
    Iterates in NodeStatus's kv_* field order (KV_COUNTERS)."""
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    transfers_done: int = 0          # committed: sent (P) or adopted-ready (D)
    transfers_failed: int = 0
    frames_dropped: int = 0          # malformed or hostile frames a decode node (or replies a prefill node) dropped


class PrefixCounters(NamedTuple):
    """Prefix-cache totals since the node started, in prompt tokens (vLLM's prefix_cache_queries
    and prefix_cache_hits): counters, so a dashboard can rate() them over any window."""
    queried_tokens: int = 0
    hit_tokens: int = 0              # <= queried_tokens


class NodeFigures(NamedTuple):
    """One heartbeat's figures, as NodeStatus carries them after node_id and epoch."""
    num_running: int
    num_waiting: int
    kv_usage: float                  # 0..1
    prefix_hit_rate: float           # 0..1
    num_preemptions: int
    num_free_blocks: int
    transfer: TransferCounters = TransferCounters()
    prefix: PrefixCounters = PrefixCounters()


KV_COUNTERS = tuple(f"kv_{name}" for name in TransferCounters._fields)   # NodeStatus's field names
PREFIX_COUNTERS = tuple(f"prefix_{name}" for name in PrefixCounters._fields)   # after KV_COUNTERS
