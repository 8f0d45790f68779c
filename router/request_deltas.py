"""One request's next delta, as both backends cut it (router/backend.py): each choice's new part,
from its stop hold (router/stop_hold.py), and the prompt's scores, which go once. The backends
build the RequestOutput around it (colocated.py's _Sink, cluster/disagg_request.py's PendingRequest).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from pdwire.outputs import CompletionOutput
from router.stop_hold import StopHold

PromptScores = list[dict[int, float] | None]    # per prompt token (the first: None)


class Delta(NamedTuple):
    outputs: list[CompletionOutput]     # the choices that have something to send
    prompt_logprobs: PromptScores | None    # the prompt's scores, the first time only


class RequestDeltas:
    """What of one request has gone out: the prompt's scores, or not yet (`scored`)."""
    __slots__ = ("scored",)

    def __init__(self, scored: bool = False):
        self.scored = scored        # the prompt's scores went out, or none are due (any later are dropped)

    def take(self, holds: Iterable[StopHold], scores: PromptScores | None, finished: bool) -> Delta | None:
        """Each hold's delta, and `scores` unless some went before; None when that is nothing
        and the request is not finished. From the first call on, later scores never go."""
        outputs = [d for hold in holds if (d := hold.take()) is not None]
        scores = None if self.scored else scores
        self.scored = True
        if not outputs and scores is None and not finished:
            return None
        return Delta(outputs, scores)
