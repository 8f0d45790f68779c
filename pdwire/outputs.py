"""What the engine returns per request, and what a router backend yields.

The engine's outputs are cumulative (each choice's text, token_ids and logprobs so far), as its
nodes' streamers need; a router backend (router/backend.py) yields the same records as deltas,
like vLLM's RequestOutputKind.DELTA: per choice, only what is new since its last delta."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CompletionOutput:
    index: int                                   # which of the request's n completions
    text: str                                    # detokenized, stop strings cut (a delta: the new text)
    token_ids: list[int]                         # generated tokens so far (a delta: the new ones)
    logprobs: list[dict[int, float]] | None      # per generated token: top-n plus the chosen one
    finish_reason: str | None                    # "stop" | "length" | "abort" | None while running


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token (the first: None)
    num_cached_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache when first scheduled
    queue_time: float | None = None   # seconds from arrival to first scheduled, as the backend saw it


@dataclass(slots=True)
class EngineMetrics:
    num_running: int
    num_waiting: int
    kv_usage: float              # fraction of blocks held by sequences or cached
    num_free_blocks: int
    num_cached_blocks: int
    num_total_blocks: int
    prefix_hit_rate: float       # prompt tokens found cached / prompt tokens allocated
    num_preemptions: int
    wasted_slots: int            # allocated token slots holding no token
    block_size: int = 0          # tokens per KV block
    prefix_queried_tokens: int = 0   # since start: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0       # since start: of those, tokens found cached
