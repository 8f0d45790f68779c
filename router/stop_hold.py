"""What one choice has produced and its client has not been sent yet, and the stop-string hold.

Both backends yield deltas (router/backend.py): each output carries, per choice, only what is
new since the last. A node's engine cuts a stop string out of the text once it completes, but
the string's start may already have been produced: so while a choice runs, its last `hold`
characters are not released (hold = the longest stop string less one, as vLLM does). What is
released is then a prefix of the final text, and a stop string is never shown, even in part:

    stop "\\n\\n", hold 1:   add "Hi\\n"   take -> "Hi"    ("\\n" held)
                           add "\\n", cut at 2 (the stop completed), finish   take -> "" + "stop"

Only text is held: token ids and logprobs go at once (a stop string's tokens are part of the
output; only its text is cut), so a client's token counts and timings never wait on the hold.
Released text is forgotten: a choice keeps only its unreleased tail, never its whole text.
"""
from __future__ import annotations

from pdwire.outputs import CompletionOutput


class StopHold:
    __slots__ = ("index", "hold", "sent", "tail", "num_tokens", "token_ids", "logprobs", "finish_reason",
                 "done")

    def __init__(self, index: int, stops: tuple[str, ...], logprobs: bool):
        self.index = index                  # which of the request's n completions
        self.hold = max(map(len, stops), default=1) - 1
        self.sent = 0                       # characters of text released
        self.tail = ""                      # text produced after them, not released yet
        self.num_tokens = 0                 # tokens produced, released or not
        self.token_ids: list[int] = []      # tokens not released yet
        self.logprobs: list[dict[int, float]] | None = [] if logprobs else None   # theirs
        self.finish_reason: str | None = None
        self.done = False                   # the last delta (with finish_reason) was taken

    @property
    def length(self) -> int:
        """Characters of text produced so far (released or not)."""
        return self.sent + len(self.tail)

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, text: str) -> None:
        """New tokens (with their logprob entries, when asked for) and the text they completed."""
        self.token_ids += token_ids
        self.num_tokens += len(token_ids)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs
        self.tail += text

    def cut(self, end: int) -> int:
        """The text now ends at character `end` (a stop string began there); never before what
        was released. Returns where it ends."""
        end = max(end, self.sent)
        self.tail = self.tail[:end - self.sent]
        return end

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def advance_to(self, whole: CompletionOutput) -> None:
        """Takes an engine's cumulative output of this choice: what it adds, or where a stop
        string cut it (the engine's text only ever shrinks by that cut, at its end)."""
        self.add(whole.token_ids[self.num_tokens:],
                 None if whole.logprobs is None else whole.logprobs[self.num_tokens:],
                 whole.text[self.length:])
        if len(whole.text) < self.length:
            self.cut(len(whole.text))
        if whole.finish_reason is not None:
            self.finish(whole.finish_reason)

    def take(self) -> CompletionOutput | None:
        """The delta to send now, or None when there is nothing to send yet (or any more)."""
        finished = self.finish_reason is not None
        keep = 0 if finished else min(self.hold, len(self.tail))
        if self.done or (len(self.tail) == keep and not self.token_ids and not finished):
            return None
        text, self.tail = self.tail[:len(self.tail) - keep], self.tail[len(self.tail) - keep:]
        delta = CompletionOutput(self.index, text, self.token_ids, self.logprobs, self.finish_reason)
        self.sent += len(text)
        self.token_ids = []
        self.logprobs = None if self.logprobs is None else []
        self.done = finished
        return delta
