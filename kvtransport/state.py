"""The state of one transfer on the receive side; it only moves forward and FAILED is final.

    RESERVED ──first frame──▶ TRANSFERRING ──all blocks + Commit──▶ COMMITTED
        │                          │
        └──────────────┬───────────┘
                       ▼
                     FAILED   (lease expired, abort from either side, peer died)
"""
from __future__ import annotations

from enum import Enum


class IllegalTransition(RuntimeError):
    """A transition the state machine does not allow (backwards, or out of a final state)."""


class TransferState(Enum):
    RESERVED = "reserved"           # blocks allocated on D, nothing arrived yet
    TRANSFERRING = "transferring"   # at least one frame of this transfer arrived
    COMMITTED = "committed"         # every expected block and the Commit arrived (final)
    FAILED = "failed"               # final; D frees the reserved blocks exactly once

    @property
    def is_final(self) -> bool:
        return self in (TransferState.COMMITTED, TransferState.FAILED)

    def advance(self, new: TransferState) -> TransferState:
        """Return `new` if self -> new is allowed, else raise IllegalTransition."""
        if new not in _NEXT[self]:
            raise IllegalTransition(f"transfer state cannot move {self.value} -> {new.value}")
        return new


_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.RESERVED: frozenset({TransferState.TRANSFERRING, TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.COMMITTED, TransferState.FAILED}),
    TransferState.COMMITTED: frozenset(),
    TransferState.FAILED: frozenset(),
}
