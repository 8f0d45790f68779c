"""What an engine tells an observer about each step (a prefill node's block shipper listens)."""
from __future__ import annotations

from typing import Protocol

from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceGroup


class StepObserver(Protocol):
    def before_forward(self, scheduled: list[ScheduledSeq]) -> None:
        """A step is about to compute `scheduled` (item.num_new_tokens of each item.seq, into its
        block table as it is now); e.g. to ship K/V layer by layer as the forward writes it."""

    def on_computed(self, group: SequenceGroup, seq: Sequence) -> None:
        """A step just computed more of `seq`'s K/V (seq.num_computed_tokens moved on), before
        its next token is sampled and before it can finish: its block table is still valid."""
