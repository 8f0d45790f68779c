"""Incremental detokenization and stop strings.

Each step decodes only a short window: the text of ids[prefix:] minus the text of
ids[prefix:read]; a trailing U+FFFD means a multi-byte character is still incomplete, so the
new text waits for the next token. The window starts with a few prompt tokens so that
tokenizers which drop a leading space on the first token decode it correctly.
"""
from __future__ import annotations

from dataclasses import dataclass

_CONTEXT = 5


@dataclass(slots=True)
class DecodeState:
    ids: list[int]          # a few prompt tokens, then every generated token
    prefix: int             # start of the window
    read: int               # end of what has been emitted as text


class Detokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens

    def start(self, prompt_ids: list[int]) -> DecodeState:
        """The prompt's last tokens count as read, except those that end in an incomplete
        multi-byte character: a request moved to another node restarts here on prompt + the
        tokens it generated, and a character its last tokens began is still to be emitted."""
        ctx = list(prompt_ids[-_CONTEXT:])
        read = len(ctx)
        while read > 1 and self.tokenizer is not None and \
                self.tokenizer.decode(ctx[:read], skip_special_tokens=self.skip).endswith("\ufffd"):
            read -= 1
        return DecodeState(ctx, 0, read)

    def step(self, state: DecodeState, token_id: int) -> str:
        """The new text that `token_id` completes (possibly empty)."""
        state.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(state.ids[state.prefix:state.read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(state.ids[state.prefix:], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        state.prefix, state.read = state.read, len(state.ids)
        return after[len(before):]


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, int]:
    """(begin, end) in `text` of the earliest stop string that the last `new_len` characters
    completed, or (-1, -1)."""
    best = (-1, -1)
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if at != -1 and (best[0] == -1 or at < best[0]):
            best = (at, at + len(stop))
    return best
