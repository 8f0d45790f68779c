"""An attempt's bookings (registry.py): its work on each of its nodes, counted from the moment
admission picks them (router/cluster/admission.py) until it ends there.

Each booking is taken and released on the control-loop message that says so, as the message
reaches the router, before any later message of the node's, not when the attempt's task reads
it: a heartbeat the node sent after it shows its effect, and handled in between, it would count
the work twice (booked pending and shown used; shown free and still booked) until the next
heartbeat or the release.

    D's Reserved                   takes D's booking (re-booked with the blocks D says it took)
    PrefillRequest sent            takes P's (the router's own act: the task's)
    D's last TokenDelta            releases D's: the request done, its blocks freed there
    any node's RequestFailed       releases that node's: the request dropped there
    P's FirstToken                 releases P's: its part done (its Commit follows)
    D's TokenDelta in a KV move    releases its writer's: D adopted the blocks the writer shipped
    the attempt's end              releases whatever is left (the disaggregated backend)

A node removed or re-registered since it was booked is a new incarnation: registry.taken() and
release() leave that one be.
"""
from __future__ import annotations

from typing import Any

from pdwire.control import FirstToken, RequestFailed, TokenDelta
from pdwire.messages import Reserved
from router.cluster.disagg_request import Attempt
from router.cluster.registry import NodeRegistry


class Bookings:
    def __init__(self, registry: NodeRegistry):
        self._registry = registry

    def book(self, att: Attempt, decode_id: str, blocks: int) -> None:
        """Books the attempt on its nodes, before either has heard of it (no att.prefill: D
        computes the prompt): on D the `blocks` it allocates, and when it prefills them itself
        (att.local) as its queued prefill work too (routing_cost.py queued(D)); on P the blocks
        it computes."""
        att.bookings[decode_id] = self._registry.book(decode_id, blocks, blocks if att.local else 0)
        if att.prefill is not None:
            att.bookings[att.prefill_id] = self._registry.book(att.prefill_id, att.prefill.new_blocks)

    def on_message(self, att: Attempt, node_id: str, msg: Any) -> None:
        """A message of the attempt's, from node_id, as it reaches the router (the table above)."""
        if node_id == att.decode_id and isinstance(msg, Reserved):
            self.taken(att, node_id, msg)
        elif isinstance(msg, RequestFailed) or (node_id == att.prefill_id and isinstance(msg, FirstToken)) \
                or (node_id == att.decode_id and isinstance(msg, TokenDelta) and msg.finish_reason):
            self.release(att, node_id)
        if att.writer and node_id == att.decode_id and isinstance(msg, TokenDelta):
            self.release(att, att.writer)

    def taken(self, att: Attempt, node_id: str, reserved: Reserved | None = None) -> None:
        """The node has the attempt's work; D's `reserved` reply re-books it with the blocks D
        took (a D from before Reserved.taken_blocks: the table's less its cached ones) and, for
        a local prefill, the blocks it computes: its true uncached tail."""
        booking = att.bookings.get(node_id)
        if booking is None:
            return
        if reserved is None:
            return self._registry.taken(booking)
        uncached = len(reserved.dst_block_ids) - reserved.cached_prefix_blocks
        taken = uncached if reserved.taken_blocks is None else reserved.taken_blocks
        self._registry.taken(booking, taken, uncached if att.local else 0)

    def release(self, att: Attempt, node_id: str) -> None:
        booking = att.bookings.pop(node_id, None)
        if booking is not None:
            self._registry.release(booking)

    def release_all(self, att: Attempt) -> None:
        for booking in att.bookings.values():
            self._registry.release(booking)
        att.bookings.clear()
