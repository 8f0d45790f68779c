"""What one choice has produced and its client has not been sent yet, and the stop-string hold.

Both backends yield deltas (router/backend.py): each output carries, per choice, only what is
new since the last. A node's engine cuts a stop string out of the text once it completes, but
the string's start may already have been produced: so while a choice runs, its last `hold`
characters are not released (hold = the longest stop string less one, as vLLM does; none when
the stop string stays in the text, include_stop_str_in_output). What is released is then a
prefix of the final text, and a stop string is never shown, even in part:

    stop "\\n\\n", hold 1:   add "Hi\\n"   take -> "Hi"    ("\\n" held)
                           add "\\n", cut at 2 (the stop completed), finish   take -> "" + "stop"

Only text is held: token ids and logprobs go at once (a stop string's tokens are part of the
output; only its text is cut), so a client's token counts and timings never wait on the hold.
Released text is forgotten: a choice keeps only its unreleased text and a window of the
released (the longest stop string less one), never its whole text. Its token ids are all kept
(the one record of them: a disaggregated choice's next attempt starts from them).
"""
from __future__ import annotations

from pdwire.outputs import CompletionOutput
from pdwire.sampling_params import SamplingParams


class StopHold:
    """One choice's text as a window on the whole (absolute character offsets):

        0 ........ base ........ sent ........ length
        forgotten  | released,    | not released  |
                   | kept: window |               |
                   └──────────── tail ───────────┘

    The window (the longest stop string less one) keeps enough released text for a stop string
    to be found across it (router/cluster/disagg_request.stop_across) when none was held.
    """
    __slots__ = ("index", "window", "hold", "base", "sent", "tail", "token_ids", "tokens_sent", "logprobs",
                 "finish_reason", "done")

    def __init__(self, index: int, params: SamplingParams):
        self.index = index                  # which of the request's n completions
        self.window = max(map(len, params.stop), default=1) - 1
        self.hold = 0 if params.include_stop_str_in_output else self.window
        self.base = 0                       # offset of tail's first character
        self.sent = 0                       # characters of text released
        self.tail = ""                      # text from base on
        self.token_ids: list[int] = []      # every token produced, released or not
        self.tokens_sent = 0                # of them, released
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None   # theirs
        self.finish_reason: str | None = None
        self.done = False                   # the last delta (with finish_reason) was taken

    @property
    def length(self) -> int:
        """Characters of text produced so far (released or not)."""
        return self.base + len(self.tail)

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, text: str) -> None:
        """New tokens (with their logprob entries, when asked for) and the text they completed."""
        self.token_ids += token_ids
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs
        self.tail += text

    def cut(self, end: int) -> int:
        """The text now ends at character `end` (a stop string began, or ended, there); never
        before what was released. Returns where it ends."""
        end = max(end, self.sent)
        self.tail = self.tail[:end - self.base]
        return end

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def advance_to(self, whole: CompletionOutput) -> None:
        """Takes an engine's cumulative output of this choice: what it adds, or where a stop
        string cut it (the engine's text only ever shrinks by that cut, at its end)."""
        produced = len(self.token_ids)
        self.add(whole.token_ids[produced:],
                 None if whole.logprobs is None else whole.logprobs[produced:],
                 whole.text[self.length:])
        if len(whole.text) < self.length:
            self.cut(len(whole.text))
        if whole.finish_reason is not None:
            self.finish(whole.finish_reason)

    def take(self) -> CompletionOutput | None:
        """The delta to send now, or None when there is nothing to send yet (or any more)."""
        finished = self.finish_reason is not None
        end = self.length if finished else max(self.sent, self.length - self.hold)
        if self.done or (end == self.sent and self.tokens_sent == len(self.token_ids) and not finished):
            return None
        delta = CompletionOutput(self.index, self.tail[self.sent - self.base:end - self.base],
                                 self.token_ids[self.tokens_sent:], self.logprobs, self.finish_reason)
        self.sent = end
        forget = max(self.base, min(self.sent, self.length - self.window))
        self.tail, self.base = self.tail[forget - self.base:], forget
        self.tokens_sent = len(self.token_ids)
        self.logprobs = None if self.logprobs is None else []
        self.done = finished
        return delta
