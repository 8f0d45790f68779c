"""EngineArgs: every knob of an engine, under one name each. `LLM(...)`'s keywords, the flags of
`python -m router`, `pdserve up` and both node CLIs are generated from it (engine/flags.py), so a
knob has the same name and help everywhere. Imports nothing heavy; engine_config() builds the
validated, nested EngineConfig the engine runs on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.grammar_limits import (COMPILE_TIMEOUT_S, MAX_COMPILED_MIB, MAX_COMPILES, MAX_QUEUED, WORKER_IDLE_TIMEOUT_S,
                                   WORKER_START_TIMEOUT_S)

if TYPE_CHECKING:
    from engine.config import EngineConfig

TP_TIMEOUT_S = 30.0     # tp > 1: how long one collective of a step may wait for the other ranks


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    model: str | None = None              # a local Hugging Face folder (safetensors); default: the built-in model
    dtype: str = "auto"                   # auto (the checkpoint's; float16 runs as bfloat16 on CPU) | float32 | bfloat16 | float16
    max_model_len: int | None = None      # longest prompt + output in tokens; default: the model's context
    device: str = "auto"                  # auto | cpu | cuda
    seed: int = 0                         # the sampling seed of requests without their own
    block_size: int = 16                  # tokens per KV block (8, 16, 32, 64 or 128)
    num_blocks: int | None = None         # KV blocks in the pool; default: as many as kv_cache_gib holds
    kv_cache_gib: float = 1.0             # KV pool memory (GiB) when num_blocks is not given
    enable_prefix_caching: bool = True    # keep full prompt blocks for reuse by later prompts (hash-chained)
    swap_space_gib: float = 0.0           # host memory (GiB) for swap preemption; 0: preempt by recompute only
    max_num_seqs: int = 64                # sequences running in one step
    max_num_batched_tokens: int = 2048    # tokens in one step: prefill chunks plus one per decoding sequence
    enable_chunked_prefill: bool = True   # split long prompts over steps; off: the context is at most max_num_batched_tokens
    long_prefill_token_threshold: int = 0  # chunked prefill: a prompt computes at most this many tokens a step (0: as many as the step's budget leaves), so a short request scheduled beside a long prompt waits for a short chunk, not a whole budget's (vLLM's --long-prefill-token-threshold); the long prompt takes more steps
    preemption_mode: str = "auto"         # recompute | swap | auto (swap long sequences when swap space allows)
    tensor_parallel_size: int = 1         # processes the heads and MLP are split over
    tensor_parallel_timeout_s: float = TP_TIMEOUT_S  # tp > 1: a rank waiting this long in one collective of a step (a worker that stopped answering) breaks the engine: a node ends with a goodbye and the router moves its requests
    grammar_compile_timeout_s: float = COMPILE_TIMEOUT_S  # a structured output's grammar compiling this long fails its requests (a 400) and its worker process is killed; one queued this long is busy (retried elsewhere). A node's loop never waits for a compile
    grammar_max_compiles: int = MAX_COMPILES  # grammars compiling at once (a worker process each)
    grammar_max_queued: int = MAX_QUEUED      # grammars waiting to compile; past them a new one is busy (retried on another node)
    grammar_worker_start_timeout_s: float = WORKER_START_TIMEOUT_S  # a grammar compile worker process (xgrammar and the tokenizer loading) not ready this long: its compile is busy and it is killed (disaggregated, the router's --admission-timeout-s, 30 s, ends the request first; the worker goes on starting)
    grammar_max_compiled_mib: float = MAX_COMPILED_MIB  # a grammar whose compiled form (its JSON, as a compile worker sends it) is larger than this fails (a 400)
    grammar_worker_idle_timeout_s: float = WORKER_IDLE_TIMEOUT_S  # a grammar compile worker process that compiled nothing this long ends (its memory freed); the next compile starts another
    freeze_gc: bool = True                # once started, freeze the process's heap out of the cyclic garbage collector's reach (gc.freeze(), as vLLM does): its collections then skip the model, the blocks and torch's modules (engine/heap.py)

    def engine_config(self) -> EngineConfig:
        from engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine.grammar_limits import GrammarLimits

        cache = CacheConfig(self.block_size, self.num_blocks, self.kv_cache_gib, self.enable_prefix_caching,
                            self.swap_space_gib)
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
                                    self.preemption_mode,
                                    long_prefill_token_threshold=self.long_prefill_token_threshold)
        return EngineConfig(self.model, self.dtype, self.max_model_len, self.device, self.seed, cache, scheduler,
                            self.tensor_parallel_size,
                            GrammarLimits(self.grammar_compile_timeout_s, self.grammar_max_compiles,
                                          self.grammar_max_queued, self.grammar_worker_start_timeout_s,
                                          self.grammar_max_compiled_mib, self.grammar_worker_idle_timeout_s),
                            tensor_parallel_timeout_s=self.tensor_parallel_timeout_s)
