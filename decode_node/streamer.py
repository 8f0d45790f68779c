"""Turns the engine's cumulative outputs into TokenDelta messages: only what is new is sent."""
from __future__ import annotations

from dataclasses import dataclass

from pdwire.outputs import RequestOutput
from pdwire.control import TokenDelta


@dataclass(slots=True)
class StreamState:
    tokens: int = 0          # generated tokens already sent
    chars: int = 0           # output text characters already sent
    before_last: int = -1    # characters sent before the last token's (-1: its delta had more)


class Streamer:
    def __init__(self) -> None:
        self.streams: dict[str, StreamState] = {}

    def open(self, rid: str) -> None:
        self.streams[rid] = StreamState()

    def drop(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def delta(self, out: RequestOutput) -> TokenDelta | None:
        """The message for what `out` adds since the last one, or None if nothing."""
        state = self.streams.get(out.request_id)
        if state is None:
            return None
        comp = out.outputs[0]
        new_tokens = comp.token_ids[state.tokens:]
        # A stop string cuts the text it completes, which may have been sent: then the delta
        # says where the text now ends (text_offset = its length, no text) with its finish reason.
        text_offset = min(state.chars, len(comp.text))
        new_text = comp.text[text_offset:]
        if not new_tokens and not comp.finish_reason:
            return None
        logprobs = None
        if comp.logprobs is not None:
            # The first token was sampled by the prefill node: no entry here, padded with [].
            entries = [[]] * (len(comp.token_ids) - len(comp.logprobs)) + list(comp.logprobs)
            logprobs = [[list(kv) for kv in e.items()] if e else [] for e in entries[state.tokens:]]
        msg = TokenDelta(out.request_id, state.tokens, new_tokens, text_offset, new_text, logprobs,
                         comp.finish_reason or "")
        state.before_last = text_offset if len(new_tokens) == 1 else -1
        state.tokens, state.chars = len(comp.token_ids), len(comp.text)
        if out.finished:
            self.drop(out.request_id)
        return msg
