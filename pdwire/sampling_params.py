"""Sampling parameters of one request, validated on construction (names follow vLLM / OpenAI)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdwire.structured_output import StructuredOutput

_EPS = 1e-5
_INT64 = 1 << 63          # integers travel between processes as msgpack int64
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "length_penalty")
_INTS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "beam_width")
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1                          # completions per prompt: a sequence group sharing the prompt
    temperature: float = 1.0            # 0 means greedy
    top_p: float = 1.0                  # nucleus mass kept, in (0, 1]
    top_k: int = -1                     # -1 or 0 keeps every token
    min_p: float = 0.0                  # drop tokens below min_p * p(max)
    presence_penalty: float = 0.0       # OpenAI-style, on generated tokens
    frequency_penalty: float = 0.0      # OpenAI-style, on generated tokens
    repetition_penalty: float = 1.0     # CTRL-style, on prompt and generated tokens
    seed: int | None = None             # the k-th token is drawn from (seed, k): same seed, same output
    max_tokens: int | None = 16         # None: up to the model's context
    min_tokens: int = 0                 # EOS / stop ids masked until this many tokens
    stop: tuple[str, ...] = ()          # stop strings, not included in the text (unless the next)
    include_stop_str_in_output: bool = False    # the stop string that ends the text stays in it
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None         # top-n logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (plus the actual one);
                                        # its prompt is computed whole, never from the prefix cache
    skip_special_tokens: bool = True
    beam_width: int = 0                 # > 0: beam search with this many beams (returns the best n)
    length_penalty: float = 1.0         # beam search: score = logprob sum / length ** length_penalty
    early_stopping: bool | str = False  # beam search: True, False or "never", as in transformers
    structured: StructuredOutput | None = None   # the output must match this grammar (engine/grammar.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.structured is not None:      # from the wire: [kind, spec]
            object.__setattr__(self, "structured", StructuredOutput.from_wire(self.structured))
        self._check()

    def _check(self) -> None:
        for name in _FLOATS:
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                     f"{name} must be a finite number, got {value!r}")
        for name in _INTS:
            value = getattr(self, name)
            _require((value is None and name in _OPTIONAL) or (type(value) is int and -_INT64 <= value < _INT64),
                     f"{name} must be an integer that fits in 64 bits, got {value!r}")
        _require(all(type(t) is int and 0 <= t < _INT64 for t in self.stop_token_ids),
                 "stop_token_ids must be non-negative integers that fit in 64 bits")
        _require(self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 0,
                 f"top_k must be -1 (off) or >= 0, got {self.top_k!r}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(-2.0 <= self.presence_penalty <= 2.0,
                 f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0,
                 f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _require(self.repetition_penalty > 0.0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _require(self.max_tokens is None or self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(self.min_tokens >= 0,
                 f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                 f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _require(self.logprobs is None or 0 <= self.logprobs <= 20,
                 f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _require(type(self.include_stop_str_in_output) is bool,
                 f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        _require(0 <= self.beam_width <= 64,
                 f"beam_width must be an integer in [0, 64], got {self.beam_width!r}")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                 f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        _require(self.beam_width == 0 or (self.logprobs is None and self.prompt_logprobs is None),
                 "logprobs is not returned by beam search: ask for one or the other")
        _require(self.beam_width == 0 or self.n <= self.beam_width,
                 f"n ({self.n}) must not exceed beam_width ({self.beam_width})")
        _require(self.structured is None or not self.use_beam_search,
                 "a structured output is not supported with beam search")
        _require(self.structured is None or self.min_tokens == 0,
                 "min_tokens cannot be combined with a structured output: the grammar decides where it ends")
        _require(self.early_stopping in (True, False, "never"),
                 f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def choice_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of an n > 1 request seeded with `seed`: seed + index,
    wrapped into int64 (engine.sampler.draw_seed only sees it modulo 2**64 anyway)."""
    return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
