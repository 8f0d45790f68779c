"""The prefill nodes that answered one choice Busy (their grammar compiler's load), as its admission
retries them (router/cluster/admission.py): each is skipped until its retry hint passes, and the
choice's first such answer starts its admission timeout, past which the choice is a 503. Once a
node computes the prompt (a prefill node's first token, or a local prefill admitted), the wait
is over: the choice starts afresh, so a migration long after is not a 503 for an old Busy.

    P Busy (retry 50 ms) ──▶ another prefill node at once, or P again once 50 ms have passed
      ... Busy again ...  ──▶ the same, until admission_timeout_s after the first Busy: 503
"""
from __future__ import annotations

from dataclasses import dataclass, field

from router.config import ADMISSION_FIRST_WAIT_S


@dataclass(slots=True)
class BusyPrefills:
    until: dict[str, float] = field(default_factory=dict)   # node -> loop time its retry hint ends
    deadline: float | None = None   # loop time: admission_timeout_s after the first Busy
    replies: int = 0
    last: str = ""                  # the last Busy's node and reason

    def note(self, node_id: str, why: str, retry_after_s: float, now: float, timeout_s: float) -> None:
        """The node said Busy (`why`: its id and reason) at `now`, to ask again after retry_after_s."""
        self.until[node_id] = now + max(retry_after_s, ADMISSION_FIRST_WAIT_S)   # (a hint of 0: not a busy loop)
        if self.deadline is None:
            self.deadline = now + timeout_s
        self.replies += 1
        self.last = why

    def refused(self, node_id: str, now: float) -> bool:
        """Whether the node's retry hint has not passed yet."""
        return self.until.get(node_id, now) > now

    def next_retry(self, now: float) -> float:
        """When the first retry hint still running passes (now if none runs)."""
        return min((t for t in self.until.values() if t > now), default=now)

    def timed_out(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def reason(self, timeout_s: float) -> str:
        return (f"every prefill node was busy for the admission timeout of {timeout_s} s "
                f"({self.replies} Busy replies; last: {self.last})")
